"""A group's prompt computed once: the rows of a micro-batch that share a prompt, packed.

GRPO samples ``n`` responses to each prompt, and every row of a group starts with the same
tokens. A forward pass over the rows as they are computes that prompt ``n`` times, and the
backward does it again; with SmolLM2's chat template around a short question the prompt is most
of a row. Here each group becomes one **unit**: the prompt once, then every row's remainder (its
first response token to its end: response, observations, later turns) one after another. A
remainder's tokens see the prompt and the earlier tokens of their own remainder, never another
row's; positions continue from the prompt in each remainder, so every token sees exactly the
keys, values and position it has in its own row and the logits are the same numbers (up to the
order of floating-point sums). The gradient is exact too: the prompt's activations collect what
every remainder sends back, which is what the separate rows' gradients add up to.

Units are packed first fit into rows no wider than the widest unit (the same rule as SFT's
packing, ``roles/modeling/text.py``), so short groups share a row and padding nearly vanishes.
Logits are computed only at the packed columns a log-prob is read from (the prompt's last token
and the remainders), then gathered back into the layout every loss reads: ``[B, W, V]`` for the
last ``W`` columns of the original ``[B, T]`` rows. Columns nobody reads (padding, a row's
prompt inside that window) get some finite logits that the masks zero.

The same for verl's remove-padding, with a shared prefix on top: a row without company is a unit
of its own, so a batch of distinct prompts is packed without padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: pack only when it saves at least this share of a micro-batch's real tokens
MIN_SAVED = 0.05


@dataclass(frozen=True)
class PromptPack:
    """A micro-batch's rows as packed units (``G`` rows of ``L`` tokens)."""

    input_ids: torch.Tensor  # [G, L]
    positions: torch.Tensor  # [G, L] each token's position in its original row
    visible: torch.Tensor  # [G, 1, L, L] bool: query i may attend to key j
    columns: torch.Tensor  # [K] packed columns whose logits are computed (every packed row)
    source: torch.Tensor  # [B, W] index into the flattened [G * K] logits, per original column
    tokens: int  # real tokens in the packed rows
    original: int  # real tokens in the original rows

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """``[G, K, V]`` logits at ``columns`` → ``[B, W, V]`` in the original rows' layout."""
        flat = logits.reshape(-1, logits.shape[-1])
        return flat[self.source.reshape(-1)].reshape(*self.source.shape, logits.shape[-1])

    def attention_mask(self, kernel: str, dtype: torch.dtype) -> torch.Tensor:
        """The visibility as the kernel takes it: sdpa a bool mask, eager an additive one (added
        to the scores as they are, so it must be a float)."""
        if kernel == "sdpa":
            return self.visible
        blocked = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
        return blocked.masked_fill_(~self.visible, torch.finfo(dtype).min)


def pack_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    window: int,
    min_saved: float = MIN_SAVED,
) -> PromptPack | None:
    """The rows packed with each distinct prompt once, or None when that saves less than
    ``min_saved`` of the real tokens (a batch of distinct prompts, SFT rows). A row's prompt is
    its real tokens before its first response token; ``window`` (``W``) is how many of the last
    columns the caller reads logits at (``T`` for all)."""
    ids_cpu, real, resp = input_ids.cpu(), attention_mask.cpu().bool(), response_mask.cpu().bool()
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    prompt_of: list[int] = []  # each row's prompt length
    for b in range(ids_cpu.shape[0]):
        tokens = ids_cpu[b][real[b]].tolist()
        responded = resp[b][real[b]].nonzero()
        first = int(responded[0]) if len(responded) else len(tokens)
        if first == 0:
            return None  # nothing before the response to share (and nothing predicts token 0)
        prompt_of.append(first)
        groups.setdefault(tuple(tokens[:first]), []).append((b, tokens[first:]))
    original = int(real.sum())
    saved = sum(len(p) * (len(rows) - 1) for p, rows in groups.items())
    if saved < min_saved * original:
        return None
    units = [_unit(prompt, rows) for prompt, rows in groups.items()]
    return _packed(units, prompt_of, real, window, original, input_ids.device)


@dataclass
class _Unit:
    ids: list[int]
    positions: list[int]
    branch: list[int]  # 0 for the prompt, i + 1 for the i-th row's remainder
    starts: dict[int, int]  # original row -> where its remainder starts in the unit
    prompt: int


def _unit(prompt: tuple[int, ...], rows: list[tuple[int, list[int]]]) -> _Unit:
    unit = _Unit(list(prompt), list(range(len(prompt))), [0] * len(prompt), {}, len(prompt))
    for i, (row, rest) in enumerate(rows):
        unit.starts[row] = len(unit.ids)
        unit.ids.extend(rest)
        unit.positions.extend(range(len(prompt), len(prompt) + len(rest)))
        unit.branch.extend([i + 1] * len(rest))
    return unit


def _packed(
    units: list[_Unit],
    prompt_of: list[int],
    real: torch.Tensor,
    window: int,
    original: int,
    device: torch.device,
) -> PromptPack:
    width = max(len(u.ids) for u in units)
    bins: list[list[tuple[_Unit, int]]] = []  # per packed row: (unit, its offset)
    fill: list[int] = []
    for unit in units:
        home = next((i for i, used in enumerate(fill) if used + len(unit.ids) <= width), None)
        if home is None:
            bins.append([])
            fill.append(0)
            home = len(bins) - 1
        bins[home].append((unit, fill[home]))
        fill[home] += len(unit.ids)
    rows = len(bins)
    ids = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    segment = torch.zeros((rows, width), dtype=torch.long)  # unit number in its row, 0 = pad
    branch = torch.zeros((rows, width), dtype=torch.long)
    where: dict[int, tuple[int, int, _Unit]] = {}  # original row -> (packed row, offset, unit)
    for g, members in enumerate(bins):
        for k, (unit, offset) in enumerate(members):
            span = slice(offset, offset + len(unit.ids))
            ids[g, span] = torch.tensor(unit.ids)
            positions[g, span] = torch.tensor(unit.positions)
            segment[g, span] = k + 1
            branch[g, span] = torch.tensor(unit.branch)
            for row in unit.starts:
                where[row] = (g, offset, unit)
    index = torch.arange(width)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] > 0)
    causal = index[None, :] <= index[:, None]
    kin = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    visible = (same & causal & kin) | torch.eye(width, dtype=torch.bool)
    # logits where a log-prob is read: a unit's last prompt token and its remainders
    needed = torch.zeros(width, dtype=torch.bool)
    for members in bins:
        for unit, offset in members:
            needed[offset + unit.prompt - 1 : offset + len(unit.ids)] = True
    columns = needed.nonzero().squeeze(-1)
    slot = torch.full((width,), -1, dtype=torch.long)
    slot[columns] = torch.arange(len(columns))
    source = _sources(real, window, prompt_of, where, slot, len(columns))
    return PromptPack(
        input_ids=ids.to(device),
        positions=positions.to(device),
        visible=visible[:, None].to(device),
        columns=columns.to(device),
        source=source.to(device),
        tokens=sum(fill),
        original=original,
    )


def _sources(
    real: torch.Tensor,
    window: int,
    prompt_of: list[int],
    where: dict[int, tuple[int, int, _Unit]],
    slot: torch.Tensor,
    kept: int,
) -> torch.Tensor:
    """For each original row and each of its last ``window`` columns, the flattened index of the
    packed logits that column's position computes (0 where no read needs it)."""
    batch, width = real.shape
    slots = slot.tolist()
    source = [[0] * window for _ in range(batch)]
    for b in range(batch):
        g, offset, unit = where[b]
        flags = real[b].tolist()
        r = sum(flags[: width - window]) - 1  # index among the row's real tokens
        for w, is_real in enumerate(flags[width - window :]):
            if not is_real:
                continue
            r += 1
            at = offset + r if r < prompt_of[b] else offset + unit.starts[b] + r - prompt_of[b]
            if slots[at] >= 0:
                source[b][w] = g * kept + slots[at]
    return torch.tensor(source, dtype=torch.long).reshape(batch, window)
