"""SFT on conversations: which tokens a multi-turn row trains on, by hand, for the byte tokenizer
(plain concatenation), a chat template, and SmolLM2's real template; and through the actor."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from controller.clients import ActorClient
from controller.supervised import text_batch
from controller.tasks import tool_arithmetic
from deploy.session import local_session
from roles.modeling.models import build_tokenizer, faithful_tokenizer, find_smollm2_gguf, init_model
from roles.modeling.text import encode_conversation, encode_rows, renders_chat
from roles.tools.calculator import calculator
from roles.tools.calls import CLOSE, OBSERVATIONS, parse_call
from tests.conftest import TEST_TIMEOUTS, group, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BOS, EOS = 257, 258  # the byte tokenizer's: ids 0..255 are the bytes
CALL = [
    {"role": "user", "content": "2*3="},
    {"role": "assistant", "content": "[c 2*3]"},
    {"role": "tool", "content": " = 6\n"},
    {"role": "assistant", "content": "6"},
]


def trained(tokenizer: Any, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_byte_tokenizer_concatenates_and_trains_on_the_assistant_bytes_and_final_eos() -> None:
    tokenizer = build_tokenizer()
    assert not renders_chat(tokenizer)  # its template is a placeholder
    ids, mask = encode_conversation(tokenizer, CALL)
    # <s>  2   *   3   =   [   c   _   2   *   3   ]   _   =   _   6  \n   6  </s>
    assert ids == [BOS, 50, 42, 51, 61, 91, 99, 32, 50, 42, 51, 93, 32, 61, 32, 54, 10, 54, EOS]
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert [i for i, m in enumerate(mask) if m] == [5, 6, 7, 8, 9, 10, 11, 17, 18]


def test_a_one_turn_conversation_is_the_prompt_response_row() -> None:
    tokenizer = build_tokenizer()
    chat = [{"role": "system", "content": "S:"}, {"role": "user", "content": "1+1="}]
    chat.append({"role": "assistant", "content": "2"})
    pair, _ = encode_rows(tokenizer, ["S:1+1="], ["2"], 64)
    talk, _ = encode_rows(tokenizer, [None], [None], 64, conversations=[chat])
    for column in ("input_ids", "attention_mask", "response_mask"):
        assert talk.tensor(column).tolist() == pair.tensor(column).tolist(), column


def test_encode_rows_mixes_pairs_and_conversations_and_cuts_long_ones() -> None:
    tokenizer = build_tokenizer()
    batch, cut = encode_rows(tokenizer, ["1+1=", None], ["2", None], 8, conversations=[None, CALL])
    assert cut == 1  # the conversation's 19 tokens, cut to 8
    assert batch.tensor("input_ids")[1].tolist() == [BOS, 50, 42, 51, 61, 91, 99, 32]
    assert batch.tensor("response_mask").tolist() == [
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]
    whole, _ = encode_rows(tokenizer, [None], [None], 64, False, conversations=[CALL])
    assert whole.tensor("response_mask")[0].tolist() == [0] + [1] * 18  # response_only=False: all


def tagged(template: str) -> PreTrainedTokenizerBase:
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.chat_template = template
    return tokenizer


def test_a_chat_template_trains_on_content_and_the_special_token_closing_the_turn() -> None:
    tokenizer = tagged(
        "{{ bos_token }}{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    chat = [CALL[0], CALL[1], {"role": "tool", "content": "6"}, CALL[3]]
    ids, mask = encode_conversation(tokenizer, chat)
    text = "<s><u>2*3=\n<a>[c 2*3]</s>\n<t>6\n<a>6</s>\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # <s><u>2*3=\n: 9 tokens; <a>: 3; [c 2*3]</s>: 8 trained; \n<t>6\n<a>: 9; 6</s>: 2 trained; \n
    assert mask == [0] * 9 + [0] * 3 + [1] * 8 + [0] * 9 + [1] * 2 + [0]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (  # later messages change what earlier ones rendered
            "{% for m in messages | reverse %}{{ m['content'] }};{% endfor %}",
            "does not render the conversation message by message",
        ),
        (  # the content is not written as given
            "{% for m in messages %}{{ m['content'] | trim }};{% endfor %}",
            r"messages\[1\] \(assistant\): the chat template does not write the content as given",
        ),
        (
            "{{ raise_exception('no tools here') }}",
            "the chat template refused the conversation: no tools here",
        ),
    ],
)
def test_a_template_whose_assistant_spans_cannot_be_found_is_refused(
    template: str, message: str
) -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}]
    with pytest.raises(ValueError, match=f"^row 3: .*{message}"):
        encode_conversation(tagged(template), chat, "row 3")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ([{"role": "bot", "content": "x"}], r"messages\[0\] has role 'bot'; use one of system"),
        ([{"role": "assistant"}], r"messages\[0\] \(assistant\): content is missing"),
        (
            [CALL[0], {"role": "assistant", "content": 6}],
            r"messages\[1\] \(assistant\): content is not a string",
        ),
        (CALL[:3], "the last message is 'tool'; a conversation to train on ends with an assistant"),
    ],
)
def test_malformed_conversations_name_the_row(messages: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^row 1: {message}"):
        encode_rows(
            build_tokenizer(), [None, None], [None, None], 64, conversations=[CALL, messages]
        )


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    gguf = find_smollm2_gguf()  # the tokenizer alone: a few seconds
    return faithful_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


SMOL_CHATS = [
    CALL,
    [{"role": "system", "content": "Be brief."}, *CALL],
    [{"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "user", "content": "Name a colour, then another."},
        {"role": "assistant", "content": " Blue,"},
        {"role": "user", "content": "and?\n"},
        {"role": "assistant", "content": "Green — ünïcode.\n\nDone"},
    ],
]


@pytest.mark.parametrize("chat", SMOL_CHATS, ids=["tool", "system", "assistant-first", "two"])
def test_smollm2_pieces_join_into_its_template_and_train_on_assistant_turns(
    smollm2: PreTrainedTokenizerBase, chat: list[dict[str, str]]
) -> None:
    assert renders_chat(smollm2)
    ids, mask = encode_conversation(smollm2, chat)
    whole = smollm2.apply_chat_template(chat, tokenize=False)
    assert ids == smollm2.encode(whole, add_special_tokens=False)  # token for token
    replies = [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
    assert trained(smollm2, ids, mask) == "".join(replies)
    end = smollm2.convert_tokens_to_ids("<|im_end|>")
    spans = [i for i, m in enumerate(mask) if m]
    for i in spans:  # a trained <|im_end|> closes an assistant turn; the newline after is not
        if ids[i] == end:
            assert mask[i + 1] == 0 and smollm2.decode(ids[i + 1 : i + 2]) == "\n"
    assert sum(ids[i] == end for i in spans) == len(replies)


def test_smollm2_two_turns_by_hand(smollm2: PreTrainedTokenizerBase) -> None:
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, mask = encode_conversation(smollm2, chat)
    head = smollm2.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    reply = smollm2.encode("Yo<|im_end|>", add_special_tokens=False)
    assert ids == [*head, *reply, *smollm2.encode("\n", add_special_tokens=False)]
    assert mask == [0] * len(head) + [1] * len(reply) + [0]


def test_smollm2_tool_demonstration_is_token_for_token_the_hermes_rollout(
    smollm2: PreTrainedTokenizerBase,
) -> None:
    """examples/smollm2_tools.yaml's SFT rows and its RL rollouts are the same tokens: the
    prompt its prompt_template writes after BOS, the sampled call, the env role's hermes
    observation, the sampled answer; SFT trains on the two sampled turns (and their ends)."""
    example = yaml.safe_load((EXAMPLES / "smollm2_tools.yaml").read_text())
    demo = next(
        r
        for r in tool_arithmetic(8, "sft", tool_share=0.5, calls="hermes")
        if len(r["messages"]) == 5
    )
    question, call = demo["messages"][1]["content"], demo["messages"][2]["content"]
    assert question == "What is 708*62?" and demo["answer"] == "43896"
    assert (
        call
        == '<tool_call>{"name": "calculator", "arguments": {"expression": "708*62"}}</tool_call>'
    )
    assert parse_call("hermes", call).arguments == {"expression": "708*62"}
    ids, mask = encode_conversation(smollm2, demo["messages"])

    def encode(text: str) -> list[int]:
        return smollm2.encode(text, add_special_tokens=False)

    prompt = [
        smollm2.bos_token_id,
        *encode(example["trainer"]["prompt_template"].format(prompt=question)),
    ]
    observation = encode(OBSERVATIONS["hermes"].format(text=calculator("708*62")))
    rollout = [*prompt, *encode(call), *observation, *encode("43896<|im_end|>")]
    assert ids == [*rollout, *encode("\n")]
    # the call turn stops on the close tag's last token, as the env role's spec says
    assert encode(call)[-1] == encode(CLOSE["hermes"])[-1]
    assert trained(smollm2, ids, mask) == call + "<|im_end|>" + "43896<|im_end|>"


def test_actor_trains_on_conversations_as_on_the_same_pairs(tmp_path: Path) -> None:
    """Through the wire and the actor: a one-turn conversation's held-out loss is its pair's,
    and a batch of tool demonstrations trains with no row cut."""
    model = init_model(tmp_path / "tiny", "tiny")
    direct = [{"prompt": f"{i}*7=", "response": str(7 * i)} for i in range(10, 18)]
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
        }
        for r in direct
    ]
    demos = tool_arithmetic(16, "sft", seed=2, tool_share=0.5)
    config = {"model": str(model), "micro_batch_size": 8, "optim": {"lr": 1e-3}}

    async def main() -> None:
        async with local_session(
            [group("g", 1, actor=("roles.actor:Actor", config))], TEST_TIMEOUTS
        ) as c:
            actor = ActorClient(c, "actor")
            pairs = await actor.sft_eval(text_batch(direct, ("prompt", "response")))
            talks = await actor.sft_eval(text_batch(chats, ("prompt", "response")))
            assert talks == pytest.approx(pairs, abs=1e-6)
            step = await actor.sft_step(text_batch(demos, ("prompt", "response")))
            # 8 direct answers (digits + eos) and 8 calls (call, answer, eos) are trained on
            answers = sum(len(r["answer"]) + 1 for r in demos)
            calls = sum(
                len(f"[calculator {r['messages'][0]['content'][:-1]}]")
                for r in demos
                if len(r["messages"]) == 4
            )
            assert step["tokens"] == answers + calls and step["truncated"] == 0

    run(main)
