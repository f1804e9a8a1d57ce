"""The built-in tools and the pieces the env role runs them with, in this process: the calculator,
schemas read from signatures, call parsing, the python sandbox (real child processes), search, the
GuessNumber environment and the deadline runner."""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from roles.tools.calculator import calculator
from roles.tools.calls import Call, MalformedCall, parse_call
from roles.tools.failures import SandboxKilled, ToolTimeout
from roles.tools.games import GuessNumber
from roles.tools.runner import Outbox, Runner
from roles.tools.sandbox import Sandbox, SandboxSettings
from roles.tools.schema import BadArguments, ToolDefinitionError, describe, parameter_docs
from roles.tools.search import Document, Index, SearchError, load_documents
from tests.waiting import wait_for

# -- calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("12*34", "408"),
        ("2**10 - 1", "1023"),
        ("(1+2)*(3+4)", "21"),
        ("7/2", "3.5"),
        ("8/2", "4"),  # a float with an integer value prints as the integer
        ("-7//2", "-4"),
        ("-7 % 3", "2"),
        ("--3", "3"),
        ("2**-2", "0.25"),
        ("0.1+0.2", "0.30000000000000004"),
        ("2**100", "1267650600228229401496703205376"),  # exact, not 1.2676506002282294e+30
        ("123456789*987654321", "121932631112635269"),
        (" 1_000 + 1 ", "1001"),
    ],
)
def test_calculator_computes_exactly(expression: str, expected: str) -> None:
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "refusal"),
    [
        ("__import__('os').system('ls')", "functions are not allowed"),
        ("x + 1", "names are not allowed"),
        ("2^3", "write 2\\*\\*3"),
        ("(1).real", "unsupported Attribute"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1 < 2", "unsupported Compare"),
        ("2**(10**9)", "exponent 1000000000 is larger than 10000"),
        ("9**9**9", "exponent 387420489 is larger"),
        ("2**5000", "too large"),
        ("10.0**400", "too large for a decimal number"),
        ("(-8)**0.5", "not a real number"),
        ("1e999", "too large for a decimal number"),  # a constant that is already inf
        ("-1e999 + 1", "too large for a decimal number"),
        ("1+", "cannot read '1\\+' as arithmetic"),
        ("1" * 501, "at most 500"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        calculator(expression)


def test_calculator_division_by_zero_raises_as_python_does() -> None:
    with pytest.raises(ZeroDivisionError):
        calculator("1/(3-3)")


# -- schemas --------------------------------------------------------------------------------------


def lookup(city: str, days: int = 1, metric: bool = True) -> str:
    """Look up the weather forecast
    for a city.

    More prose the model does not need.

    Args:
        city: the city's name,
            as people write it.
        days (int): how many days ahead.

    Returns:
        the forecast.
    """
    return f"{city} {days} {metric}"


def test_schema_comes_from_the_signature_and_the_docstring() -> None:
    tool = describe(lookup, "tests.roles.test_tools:lookup")
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {
                        "type": "string",
                        "description": "the city's name, as people write it.",
                    },
                    "days": {
                        "type": "integer",
                        "description": "how many days ahead.",
                        "default": 1,
                    },
                    "metric": {"type": "boolean", "default": True},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    assert tool.first == "city" and tool.required == ("city",)


def test_arguments_are_checked_against_the_signature() -> None:
    tool = describe(lookup, "lookup")
    assert tool.arguments({"city": "Oslo", "days": "3"}) == {
        "city": "Oslo",
        "days": 3,
        "metric": True,
    }
    assert tool.arguments("Paris") == {"city": "Paris", "days": 1, "metric": True}
    with pytest.raises(BadArguments, match=r"bad arguments for lookup: city: Field required"):
        tool.arguments({"days": 2})
    with pytest.raises(BadArguments, match=r"days: Input should be a valid integer"):
        tool.arguments({"city": "Oslo", "days": "soon"})
    with pytest.raises(BadArguments, match=r"units: Extra inputs are not permitted"):
        tool.arguments({"city": "Oslo", "units": "C"})


def no_doc(x: str) -> str:
    return x


def no_hint(x) -> str:
    """Has a docstring."""
    return str(x)


def star(*xs: str) -> str:
    """Takes any number."""
    return "".join(xs)


def nothing() -> str:
    """Takes no arguments."""
    return "ok"


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (no_doc, "has no docstring"),
        (no_hint, "parameter 'x' has no type hint"),
        (star, "parameter 'xs' is variadic positional"),
    ],
)
def test_a_function_that_cannot_be_a_tool_is_refused_saying_why(fn: Any, why: str) -> None:
    with pytest.raises(ToolDefinitionError, match=why):
        describe(fn, f"m:{fn.__name__}")


def test_a_tool_without_parameters_takes_a_bare_bracket_call() -> None:
    tool = describe(nothing, "m:nothing")
    assert tool.first is None and tool.arguments(None) == {}
    with pytest.raises(BadArguments, match="takes no arguments"):
        tool.arguments("extra")


def test_parameter_docs_read_google_style_sections_only() -> None:
    assert parameter_docs("Just prose.\n\nx: not an Args section") == {}
    doc = "Do it.\n\nArgs:\n    a: first\n    *rest: more\n\nRaises:\n    b: not a parameter"
    assert parameter_docs(doc) == {"a": "first", "rest": "more"}


# -- calls ----------------------------------------------------------------------------------------


def test_bracket_calls_are_read_from_the_end_of_the_turn() -> None:
    assert parse_call("bracket", "so [calculator 12*34]") == Call("calculator", "12*34")
    assert parse_call("bracket", "[x 1] then [search capital of France]\n") == Call(
        "search", "capital of France"
    )
    assert parse_call("bracket", "[now]") == Call("now", None)
    assert parse_call("bracket", "[python print( 1 )]") == Call("python", "print( 1 )")


def test_hermes_calls_are_json_between_the_tags() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse_call("hermes", text) == Call("calculator", {"expression": "2+3"})
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_call("hermes", as_string) == Call("f", {"a": 1})
    assert parse_call("hermes", '<tool_call>{"name": "f"}</tool_call>') == Call("f", {})


@pytest.mark.parametrize(
    ("fmt", "text", "why"),
    [
        ("bracket", "the answer is 4", "does not end with ']'"),
        ("bracket", "calculator 1+1]", "has no '\\[' before it"),
        ("bracket", "[ calculator]", "does not start with a tool name"),
        ("hermes", "<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ("hermes", "<tool_call>[1, 2]</tool_call>", "a JSON list, not an object"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', 'no "name" string'),
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
        ("hermes", '<tool_call>{"name": "f", "args": {}}</tool_call>', "keys \\['args'\\]"),
        ("hermes", '{"name": "f"}</tool_call>', "has no '<tool_call>' before it"),
        ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>", "nested too deeply"),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
            "not valid JSON",
        ),
    ],
)
def test_a_call_that_cannot_be_read_says_why(fmt: Any, text: str, why: str) -> None:
    with pytest.raises(MalformedCall, match=why):
        parse_call(fmt, text)


# -- the python sandbox ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(SandboxSettings(memory_mb=256, timeout_s=3.0, output_chars=2000))


def test_the_sandbox_runs_code_and_returns_stdout_and_stderr_in_order(box: Sandbox) -> None:
    code = "import sys\nprint('out 1')\nprint('err', file=sys.stderr)\nprint(sum(range(10)))"
    assert box.run(code) == "out 1\nerr\n45"
    assert box.run("pass") == "(no output)"
    failed = box.run("import sys\nprint('partial')\nsys.exit(3)")
    assert failed == "partial\n[exit status 3]"
    raised = box.run("1/0")
    assert raised.startswith('Traceback (most recent call last):\n  File "main.py", line 1')
    assert "ZeroDivisionError: division by zero\n[exit status 1]" in raised
    assert "sandbox_child" not in raised  # the traceback starts at the user's code


def test_long_output_is_cut_and_says_so(box: Sandbox) -> None:
    out = box.run("print('x' * 10000)")
    assert out.startswith("x" * 2000 + "\n[... 8001 more bytes of output cut]")


def test_a_memory_hog_is_killed(box: Sandbox) -> None:
    with pytest.raises(SandboxKilled, match=r"ran out of memory \(its limit is 256 MiB"):
        box.run("hog = bytearray(1024 * 1024 * 1024)\nprint('allocated')")
    with pytest.raises(SandboxKilled, match="ran out of memory"):
        box.run("hog = []\nwhile True:\n    hog.append(' ' * 10**6)")


def test_an_endless_loop_is_stopped_at_the_wall_clock_limit(box: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match=r"time limit of 3 s \(sandbox_timeout_s\)") as info:
        box.run("print('started', flush=True)\nwhile True:\n    pass")
    assert "started" in str(info.value)  # what it printed before
    assert 3.0 <= time.monotonic() - started < 6.0


def test_the_network_is_refused(box: Sandbox) -> None:
    for code in (
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))",
    ):
        out = box.run(code)
        assert "PermissionError: the network is off in this sandbox" in out, out


def test_the_kernel_keeps_the_network_off_even_past_the_audit_hook(box: Sandbox) -> None:
    if box.isolation()["network"] != "namespace":
        pytest.skip("no user/network namespaces here: only the audit hook refuses sockets")
    # ctypes reaches libc's socket() without the audit hook seeing it: seccomp refuses an
    # internet socket while the network is off (and under it, the namespace has no route)
    code = (
        "import ctypes, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0), ctypes.get_errno())"
    )
    assert box.run(code) == f"-1 {errno.EPERM}"


def test_the_network_can_be_allowed() -> None:
    open_box = Sandbox(SandboxSettings(network=True, timeout_s=5.0))
    assert open_box.isolation()["network"] == "allowed"
    assert (
        open_box.run("import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\nprint('ok')")
        == "ok"
    )


def test_files_can_be_written_in_the_working_folder_only(box: Sandbox, tmp_path: Path) -> None:
    outside = tmp_path / "escaped.txt"
    code = (
        "open('notes.txt', 'w').write('kept')\n"
        "print(open('notes.txt').read())\n"
        f"open({str(outside)!r}, 'w').write('no')"
    )
    out = box.run(code)
    assert out.startswith("kept\n")
    assert "PermissionError" in out and not outside.exists()
    # each call starts in a fresh, empty folder
    assert box.run("import os\nprint(sorted(os.listdir('.')))") == "['main.py']"


def test_the_project_and_system_secrets_cannot_be_read(box: Sandbox) -> None:
    if not box.isolation()["files"].startswith("landlock"):
        pytest.skip("no Landlock here: reads are not restricted")
    project = Path(__file__).resolve().parents[2] / "pyproject.toml"
    for path in (str(project), "/etc/passwd"):
        out = box.run(f"print(open({path!r}).read())")
        assert "PermissionError: [Errno 13] Permission denied" in out, out
    assert box.run("import numpy\nprint(numpy.arange(4).sum())") == "6"  # packages still load


def test_the_code_sees_none_of_the_callers_environment(
    box: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", "hunter2")
    assert box.run("import os\nprint(os.environ.get('HYBRIDFLOW_TEST_SECRET'))") == "None"


def test_the_python_tool_uses_the_configured_sandbox() -> None:
    from roles.tools import sandbox

    sandbox.configure(SandboxSettings(memory_mb=128, timeout_s=2.0))
    try:
        with pytest.raises(SandboxKilled, match="its limit is 128 MiB"):
            sandbox.python("hog = bytearray(512 * 1024 * 1024)")
        assert sandbox.python("print(6 * 7)") == "42"
    finally:
        sandbox.configure(SandboxSettings())


# -- search ---------------------------------------------------------------------------------------

DOCUMENTS = [
    Document("Paris", "Paris is the capital and largest city of France."),
    Document("Bread", "Bread is baked from flour, water and yeast."),
    Document("Berlin", "Berlin is the capital of Germany, on the river Spree."),
    Document("Rivers", "The Seine flows through Paris; the Spree through Berlin."),
]


def test_search_returns_the_relevant_document_first_with_its_title() -> None:
    index = Index(DOCUMENTS, top_k=2)
    ranked = index.ranked("What is the capital of France?")
    assert ranked[0][0].title == "Paris"
    assert len(ranked) == 2
    assert index.search("how is bread baked").startswith("[1] Bread\nBread is baked from flour")
    assert index.search("zebra") == "No document matches 'zebra'."
    assert index.search("the of and") == "No document matches 'the of and'."


def test_documents_load_from_a_folder_or_a_jsonl_file(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "europe").mkdir(parents=True)
    (folder / "europe" / "Paris.txt").write_text("Paris is the capital of France.")
    (folder / "Bread.txt").write_text("Bread is baked.")
    assert load_documents(folder) == [
        Document("Bread", "Bread is baked."),
        Document("europe/Paris", "Paris is the capital of France."),
    ]
    jsonl = tmp_path / "docs.jsonl"
    rows = [{"title": "A", "text": "alpha"}, {"text": "beta"}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_documents(jsonl) == [Document("A", "alpha"), Document("docs 2", "beta")]
    jsonl.write_text('{"title": "A", "text": "alpha"}\n{"title": "B"}\n')
    with pytest.raises(SearchError, match=r"docs.jsonl line 2 needs an object with a \"text\""):
        load_documents(jsonl)
    with pytest.raises(SearchError, match="neither a folder"):
        load_documents(tmp_path / "missing")


# -- GuessNumber ----------------------------------------------------------------------------------


def test_guess_number_answers_higher_or_lower_and_rewards_the_right_guess() -> None:
    game = GuessNumber(max_moves=3)
    assert game.reset({"secret": 42}) == "Guess my number from 1 to 100."
    assert game.step("I say 50") == ("50? Go lower.", 0.0, False, {"moves": 1})
    assert game.step("hmm") == ("Say a number.", 0.0, False, {"moves": 2})
    assert game.step("then 30 or 42") == ("42 is right.", 1.0, True, {"moves": 3})
    game.reset({"secret": 7})
    game.step("1")
    game.step("2")
    assert game.step("3") == ("3 is wrong; it was 7.", 0.0, True, {"moves": 3})
    with pytest.raises(KeyError, match="needs a 'secret' column"):
        game.reset({})


# -- the runner -----------------------------------------------------------------------------------


def test_a_late_piece_is_given_up_at_its_deadline_and_frees_its_slot() -> None:
    runner = Runner(workers=1, timeout_s=0.5)
    release = threading.Event()
    outbox: Outbox[tuple[str, str]] = Outbox()

    def stuck() -> tuple[str, str]:
        release.wait(30)  # until the test lets it go
        return "stuck", "finished"

    started = time.monotonic()
    late = runner.start(stuck, lambda s: ("stuck", f"late after {s:.1f}"))
    after = runner.start(lambda: ("after", "ran"), lambda s: ("after", "late"))
    for future in (late, after):
        future.add_done_callback(lambda f: outbox.put(f.result()))
    first = outbox.take(10)
    assert first[0] == ("stuck", "late after 0.5")
    assert 0.5 <= time.monotonic() - started < 3
    assert runner.abandoned == 1
    rest = first[1:] or outbox.take(10)
    assert rest == [("after", "ran")]  # the slot went to the next piece at the deadline
    release.set()
    wait_for(lambda: runner.abandoned == 0, 10, "the given-up thread counted back when it ended")
    assert late.result() == ("stuck", "late after 0.5")  # the thread's own result was dropped


def test_an_empty_outbox_waits_for_the_first_result_only() -> None:
    outbox: Outbox[int] = Outbox()
    started = time.monotonic()
    assert outbox.take(0.2) == []
    assert time.monotonic() - started >= 0.2
    threading.Timer(0.1, outbox.put, args=(7,)).start()
    assert outbox.take(10) == [7]


def test_the_sandbox_makes_its_root_again_when_a_cleaner_removed_it(tmp_path: Path) -> None:
    """A long run outlives /tmp's cleaner: the calls' root is made again, not an error."""
    box = Sandbox(SandboxSettings(timeout_s=5.0, root=str(tmp_path)))
    assert box.run("print(1)") == "1"
    first = box.root
    first.rmdir()
    assert box.run("print(2)") == "2"
    assert box.root != first and box.root.parent == tmp_path
