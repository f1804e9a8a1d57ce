"""Names of the batch columns and meta keys that cross between the controller and the roles.

A ``TensorBatch`` names its columns with strings; both sides of a call must spell them the same,
so the ones a role reads or writes live here, once. A role that needs a column it does not find
raises ``BatchError`` naming it (``TensorBatch.require_tensors``).
"""

from __future__ import annotations

# -- token rows (training layout: prompt then response, right-padded) ---------------------------
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
RESPONSE_MASK = "response_mask"  # 1 on the tokens a loss counts (response, not tool or pad)
#: the columns every token batch a training role takes has
TOKENS = (INPUT_IDS, ATTENTION_MASK, RESPONSE_MASK)

# -- per-token numbers [B, T], aligned with input_ids -------------------------------------------
LOG_PROBS = "log_probs"  # from generate (the generator's) or compute_log_prob (the trainer's)
ENTROPY = "entropy"
OLD_LOG_PROBS = "old_log_probs"  # pi_old, recomputed by the actor before an update
REF_LOG_PROBS = "ref_log_probs"
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # the generator's own, for TIS / decoupled PPO
ADVANTAGES = "advantages"
WEIGHTS = "weights"  # per-token weights of a cross-entropy loss (forward_backward_nll)
RATIO_MASK = "ratio_mask"  # GSPO: the tokens whose mean log-ratio is the sequence ratio
VALUES = "values"
RETURNS = "returns"

# -- per-row results -----------------------------------------------------------------------------
SCORES = "scores"  # a reward or cost role's score [B]
LOGITS = "logits"  # next-token logits after each prompt [B, V] (rollout.prompt_logits)
CHOSEN = "chosen"  # preference pairs: text in, scores out (reward model)
REJECTED = "rejected"

# -- text and generation columns (non-tensor) ----------------------------------------------------
PROMPT = "prompt"
#: an SFT row's conversation, in place of prompt and response: [{"role", "content"}, ...]
MESSAGES = "messages"
PROMPT_IDS = "prompt_ids"
RESPONSE = "response"
SESSION = "session"  # a multi-turn request's trajectory: the generator keeps its KV cache
REPLICA = "replica"  # a generation row's dp replica: its session's KV is kept there
PREFIX_REUSED = "prefix_reused"  # per reply row: prompt positions taken from its kept session
SEED = "seed"  # a request's own seed: it samples the same on whichever dp rank it lands
CONTINUATION = "continuation"  # [sample, offset]: continue a sample of an earlier call
FINISH = "finish"  # why a sample ended: stop or length
REQUEST = "request"  # index of the prompt a sample answers, within its call
#: [B] 1 on a text row the client repeated so every dp rank of a training call has one: it must
#: count in no loss and no count (text rows have no response_mask to zero)
IDLE = "idle"

# -- meta keys -----------------------------------------------------------------------------------
WEIGHT_VERSION = "weight_version"  # the policy version whose weights generated a batch
TEMPERATURE = "temperature"  # the temperature a sampled batch was drawn at (its log-probs')
PAD_VALUES = "pad_values"  # column → the value its padding holds (input_ids: the pad token)
