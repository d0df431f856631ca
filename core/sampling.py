"""The seeded sampler: one definition of a sampled token, shared by the control, the decoders and the audit.

A sampled token at absolute position ``p`` (the index of the token in prompt + output) is

    argmax over allowed v of  logits[v] / T + G(seed, p, v)

with ties going to the smallest ``v``. ``G`` is standard Gumbel noise, ``-log(-log(u))``, where
``u = (h + 0.5) / 2**32`` and ``h`` is a 32-bit counter-based hash of (seed, p, v) computed with
integer tensor ops that never overflow: its bits do not depend on the device, the batch, or how
many tokens came before. The allowed set is what top-k, then top-p, then min-p keep of the
softmax of ``logits / T`` (HF's order of warpers). By the Gumbel-max trick the token is an exact
sample from the filtered softmax (tests/test_sampling.py checks it with a chi-square test), and
because the noise is a function of the position alone, a speculative decoder that reaches the same
logits at the same position emits the same token: "exact" keeps its meaning under sampling.

The filters work on the candidates, not the vocabulary: tokens are ranked by their logit (as a
float32 value, exact for bf16, fp16 and fp32 logits; equal logits by the smaller id) through unique
int64 keys, so the ranking is integer arithmetic that no kernel or batch can reorder. top-k takes
the first k; top-p and min-p then run on those k values in rank order, and the noise is computed at
those k ids only. A pick thus costs one pass over the vocabulary (the keys and a top-k) and a few
ops on k values; only ``top_k = 0`` with ``top_p < 1`` sorts the vocabulary.

``T = 0`` is greedy decoding, ``argmax(logits)``, bit for bit the control's unsampled token.

Every function here works on ONE row of logits (a 1-D tensor), each in its own call, so a verify
window's row, the control's ``[1, V]`` logits and a lone step's row go through the same kernels on
the same shapes. The one exception is ``pick_rows_from_keys``, a window's rows in one call: it
batches only the stages whose every element is computed alone (the ranking keys, the top-k of
unique integer keys, the hash, the elementwise float ops, the max and the id of the best) and runs
each row's reductions over floats (top-p's softmax and cumulative sum) on that row alone, so each
row gets the bits ``pick_from_keys`` gives it (tests/test_sampling.py; tests/test_cuda.py on the
device).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

NAME = "gumbel-max/v2"
ID_BITS = 20  # a ranking key holds the token id in its low bits: vocabularies up to 2**20
_M32 = 0xFFFFFFFF

# Qwen's recommended settings (Qwen3 model cards): thinking mode, and everything else
PRESETS = {
    "qwen-thinking": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
    "qwen-instruct": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0},
}


class SamplerError(ValueError):
    """A sampler description that does not define a sampler (the CLIs show it as one line)."""


@dataclass(frozen=True)
class Sampler:
    """What decides a token. ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch their filter off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        t, k, p, m, s = self.temperature, self.top_k, self.top_p, self.min_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise SamplerError(f"temperature must be a finite number >= 0, not {t!r}")
        if not _is_int(k) or k < 0:
            raise SamplerError(f"top_k must be an integer >= 0 (0: off), not {k!r}")
        if not _is_real(p) or not 0 < p <= 1:
            raise SamplerError(f"top_p must be in (0, 1] (1: off), not {p!r}")
        if not _is_real(m) or not 0 <= m < 1:
            raise SamplerError(f"min_p must be in [0, 1) (0: off), not {m!r}")
        if not _is_int(s) or not 0 <= s < 2 ** 64:
            raise SamplerError(f"seed must be an integer in [0, 2**64), not {s!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(m))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict:
        return {"name": NAME, **asdict(self)}

    @classmethod
    def from_json(cls, doc) -> "Sampler":
        """The sampler a stream or record names; a missing one (``None``) is greedy."""
        if doc is None:
            return GREEDY
        if not isinstance(doc, dict) or doc.get("name") != NAME:
            raise SamplerError(f"not a {NAME} sampler: {doc!r:.200}")
        fields = {k: v for k, v in doc.items() if k != "name"}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise SamplerError(f"unknown sampler field(s): {', '.join(sorted(unknown))}")
        return cls(**fields)

    @classmethod
    def parse(cls, text: str) -> "Sampler":
        """``greedy``, a preset (``qwen-thinking``), ``key=value,...``, or a preset followed by
        overrides: ``qwen-thinking,seed=7``. Keys: temperature (or t), top_k, top_p, min_p, seed,
        each at most once. A filter at temperature 0, or a seed with no temperature and no preset
        (greedy decoding would ignore either), is refused."""
        fields: dict = {}
        given: list[str] = []
        preset = False
        for i, part in enumerate(p.strip() for p in str(text).split(",")):
            if not part:
                raise SamplerError(f"empty item in sampler {text!r}")
            if "=" not in part:
                if part not in (*PRESETS, "greedy"):
                    raise SamplerError(f"unknown sampler preset {part!r} (presets: greedy, {', '.join(PRESETS)})")
                if i:
                    raise SamplerError(f"preset {part!r} must come first, before any key=value item")
                fields.update(PRESETS.get(part, {}))
                preset = True
                continue
            key, value = (s.strip() for s in part.split("=", 1))
            key = {"t": "temperature", "temp": "temperature"}.get(key, key)
            if key not in cls.__dataclass_fields__:
                raise SamplerError(f"unknown sampler key {key!r} (keys: temperature, top_k, top_p, min_p, seed)")
            if key in given:
                raise SamplerError(f"sampler key {key!r} given twice")
            given.append(key)
            integer = key in ("top_k", "seed")
            try:
                fields[key] = int(value) if integer else float(value)
            except ValueError:
                raise SamplerError(f"sampler {key}={value!r} is not {'an integer' if integer else 'a number'}") from None
        sampler = cls(**fields).require_effective()
        if sampler.greedy and "seed" in given and "temperature" not in given and not preset:
            raise SamplerError(f"seed={sampler.seed} without a temperature samples nothing: give a temperature "
                               "above 0 to sample (or temperature=0 for greedy)")
        return sampler

    def require_effective(self) -> "Sampler":
        """Itself, unless a filter is set at temperature 0, where greedy decoding would ignore it
        (a user who forgot the temperature would believe they sampled): a SamplerError then."""
        if self.greedy:
            for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
                if getattr(self, name) != off:
                    raise SamplerError(f"{name}={getattr(self, name):g} has no effect at temperature 0 (greedy): "
                                       "give a temperature above 0 to sample")
        return self

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature={self.temperature:g}"]
        parts += [f"top_k={self.top_k}"] if self.top_k else []
        parts += [f"top_p={self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min_p={self.min_p:g}"] if self.min_p > 0 else []
        return ",".join(parts + [f"seed={self.seed}"])

    def pick(self, logits: torch.Tensor, position: int) -> int:
        """The token at absolute ``position`` from one row of logits ``[V]`` (or ``[1, V]``)."""
        return int(self.pick_tensor(logits, position).item())

    def pick_tensor(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """As ``pick``, as a 0-d int64 tensor on the logits' device (no host sync)."""
        row = logits.reshape(-1)
        if self.greedy:
            return row.argmax(-1)
        return pick_from(row, self, self.seed, position)

    def pick_rows(self, logits: torch.Tensor, first_position: int) -> torch.Tensor:
        """One token per row of ``[R, V]`` logits, row r at position ``first_position + r``:
        row by row, so each row's token is the one ``pick`` gives it alone. int64 ``[R]``."""
        rows = logits.reshape(-1, logits.shape[-1])
        if self.greedy:
            return torch.stack([r.argmax(-1) for r in rows])
        return torch.stack([self.pick_tensor(r, first_position + i) for i, r in enumerate(rows)])



def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mul32(x, c: int):
    """``x * c mod 2**32`` for 32-bit ``x`` (an int or int64 tensor) and constant ``c``, with no
    intermediate above 2**49: the constant is split in 16-bit halves, so nothing overflows int64
    (on a tensor, ``x * lo`` and the add are one kernel)."""
    lo, hi = c & 0xFFFF, c >> 16
    if isinstance(x, torch.Tensor):
        return torch.add(((x * hi) & 0xFFFF) << 16, x, alpha=lo) & _M32
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    """A 32-bit avalanche finalizer (lowbias32): every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed):
    """The 32-bit key of a seed (an int, or an int64 tensor holding its bits), the half of
    ``position_key`` that does not depend on the position."""
    k = _fmix32((seed & _M32) ^ 0x9E3779B9)
    return _fmix32(k ^ ((seed >> 32) & _M32))


def position_keys(skey, position):
    """The two 32-bit keys of (seed, position) from the seed's ``seed_key``."""
    k1 = _fmix32(skey ^ (position & _M32))
    k2 = _fmix32(k1 ^ ((position >> 32) & _M32) ^ 0x85EBCA6B)
    return k1, k2


def position_key(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit keys of (seed, position): exact integers on the host, or int64 tensors."""
    return position_keys(seed_key(seed), position)


def hash_bits(seed: int, position: int, vocab: int, device=None) -> torch.Tensor:
    """``h(seed, position, v)`` for v in [0, vocab): int64 values in [0, 2**32)."""
    k1, k2 = position_key(seed, position)
    v = torch.arange(vocab, dtype=torch.int64, device=device)
    return _fmix32((_fmix32(v ^ k1) + k2) & _M32)


def gumbel(seed: int, position: int, vocab: int, device=None) -> torch.Tensor:
    """Standard Gumbel noise ``G(seed, position, v)`` for every v, float64 ``[vocab]``."""
    return noise_at(seed, position, torch.arange(vocab, dtype=torch.int64, device=device))


GREEDY = Sampler()


def ranking_keys(row: torch.Tensor) -> torch.Tensor:
    """Each token's unique int64 ranking key: its float32 logit's bits made order-preserving as an
    integer, shifted up, with ``2**ID_BITS - 1 - id`` below (a larger key: a larger logit, or an
    equal logit and a smaller id). Every key is >= 0."""
    return ranking_keys_rows(row.reshape(1, -1)).reshape(-1)


def ranking_keys_rows(rows: torch.Tensor) -> torch.Tensor:
    """``ranking_keys`` of each row of ``[R, V]`` at once: elementwise ops, so each row's keys are
    the ones it has alone."""
    vocab = rows.shape[-1]
    if vocab > 1 << ID_BITS:
        raise ValueError(f"a vocabulary of {vocab} tokens is more than the sampler ranks (2**{ID_BITS})")
    bits = (rows.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ranks as +0.0
    order = torch.where(bits >= 0, bits + (1 << 31), -1 - bits)  # IEEE sign-magnitude -> increasing integers
    low = (1 << ID_BITS) - 1
    return (order << ID_BITS) | (low - torch.arange(vocab, dtype=torch.int64, device=rows.device))


def ranked(row: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest logits of ``row``, largest first, equal logits by the smaller
    id: int64 ``[k]``, from the unique ``ranking_keys`` (so one answer on every device)."""
    low = (1 << ID_BITS) - 1
    return low - (top_keys(ranking_keys(row), k) & low)


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of unique keys along the last dimension, largest first (all of them,
    sorted, when k is the whole row)."""
    if k < keys.shape[-1]:
        return torch.topk(keys, k, dim=-1).values
    return torch.sort(keys, dim=-1, descending=True).values


def candidates(row: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens a pick chooses among: (ids int64, z = logits[ids] / T float64, kept bool), each
    ``[k]``. With top-k on, the k best in rank order (``ranked``); top-p keeps, of their
    renormalized softmax in that order, each token whose preceding mass is below p (so the token
    that crosses p is kept, and always the first); min-p keeps those whose probability is at least
    min_p times the largest. Without top-k, top-p ranks the whole vocabulary; with neither, the
    candidates are the vocabulary in id order."""
    vocab = row.numel()
    k = sampler.top_k if 0 < sampler.top_k < vocab else vocab
    if k < vocab or sampler.top_p < 1:
        ids = ranked(row, k)
        z = row[ids].to(torch.float64) / sampler.temperature
        top = z[:1]
    else:
        ids = torch.arange(vocab, dtype=torch.int64, device=row.device)
        z = row.to(torch.float64, copy=True) / sampler.temperature
        top = z.max()
    kept = torch.ones(k, dtype=torch.bool, device=row.device)
    if sampler.top_p < 1:
        probs = torch.softmax(z, 0)
        kept = torch.cumsum(probs, 0) - probs < sampler.top_p
        kept[:1].fill_(True)  # a fill: assigning a Python scalar copies it from the host (a sync, uncapturable)
    if sampler.min_p > 0:
        kept = kept & (torch.exp(z - top) >= sampler.min_p)
    return ids, z, kept


def noise_at(seed, position, ids: torch.Tensor) -> torch.Tensor:
    """``G(seed, position, v)`` at int64 token ids ``v`` (float64, shaped like ``ids``). ``seed``
    and ``position`` are ints or int64 tensors (a seed above 2**63 - 1 as its two's-complement
    int64): the hash is integer arithmetic, so either gives the same bits."""
    return noise_from_keys(*position_key(seed, position), ids)


def noise_from_keys(k1, k2, ids: torch.Tensor) -> torch.Tensor:
    """``noise_at`` from the position's two keys (``position_key``: ints or int64 tensors)."""
    h = _fmix32((_fmix32(ids ^ k1) + k2) & _M32)
    u = (h.to(torch.float64) + 0.5) * 2.0 ** -32
    return -torch.log(-torch.log(u))


def pick_from(row: torch.Tensor, sampler: Sampler, seed, position) -> torch.Tensor:
    """The sampled token of one row ``[V]`` at ``position``: ``sampler``'s filters, the noise of
    ``seed`` (ints or int64 tensors, as ``noise_at``). 0-d int64; no host sync, so a CUDA graph
    can capture it with the seed and position in device tensors."""
    return pick_from_keys(row, sampler, *position_key(seed, position))


def pick_from_keys(row: torch.Tensor, sampler: Sampler, k1, k2) -> torch.Tensor:
    """``pick_from`` given the position's two keys (``position_key``), e.g. computed on the host
    and read by a CUDA graph from a device tensor."""
    ids, z, kept = candidates(row, sampler)
    score = torch.where(kept, z + noise_from_keys(k1, k2, ids), -math.inf)
    best = score.max()
    return torch.where(score == best, ids, row.numel()).min()  # ties: the smallest id


def pick_rows_from_keys(rows: torch.Tensor, sampler: Sampler, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """``pick_from_keys`` of each row of ``[R, V]`` logits in one call, row r with the keys
    ``k1[r]``, ``k2[r]`` (int64 ``[R]``): int64 ``[R]``, each the token ``pick_from_keys`` gives
    that row alone. Unique integer keys have one top-k on any device and batch, integer and
    elementwise float ops compute every element alone, max and min are exact; only top-p's float
    reductions depend on how a kernel groups its sums, so they run row by row on ``[k]`` rows, as
    in ``candidates``. No host sync."""
    rows = rows.reshape(-1, rows.shape[-1])
    n, vocab = rows.shape
    k = sampler.top_k if 0 < sampler.top_k < vocab else vocab
    low = (1 << ID_BITS) - 1
    if k < vocab or sampler.top_p < 1:
        ids = low - (top_keys(ranking_keys_rows(rows), k) & low)
        z = rows.gather(-1, ids).to(torch.float64) / sampler.temperature
        best_z = z[:, :1]
    else:
        ids = torch.arange(vocab, dtype=torch.int64, device=rows.device).expand(n, vocab)
        z = rows.to(torch.float64, copy=True) / sampler.temperature
        best_z = z.max(-1, keepdim=True).values
    kept = torch.ones(n, k, dtype=torch.bool, device=rows.device)
    if sampler.top_p < 1:
        for r in range(n):
            probs = torch.softmax(z[r], 0)
            kept[r].copy_(torch.cumsum(probs, 0) - probs < sampler.top_p)
        kept[:, :1].fill_(True)
    if sampler.min_p > 0:
        kept = kept & (torch.exp(z - best_z) >= sampler.min_p)
    score = torch.where(kept, z + noise_from_keys(k1.view(n, 1), k2.view(n, 1), ids), -math.inf)
    best = score.max(-1, keepdim=True).values
    return torch.where(score == best, ids, vocab).min(-1).values


def allowed_mask(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """Which tokens of one logits row the filters keep (``candidates``), as a ``[V]`` bool mask."""
    row = logits.reshape(-1)
    ids, _, kept = candidates(row, sampler)
    return torch.zeros(row.numel(), dtype=torch.bool, device=row.device).index_put_((ids,), kept)


def probabilities(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """The distribution a sampled token follows: the filtered softmax of ``logits / T`` (float64);
    for greedy, all mass on the argmax. For tests and the audit's reports, not for decoding."""
    row = logits.reshape(-1)
    if sampler.greedy:
        out = torch.zeros(row.numel(), dtype=torch.float64, device=row.device)
        out[row.argmax()] = 1.0
        return out
    z = row.to(torch.float64, copy=True) / sampler.temperature
    return torch.softmax(torch.where(allowed_mask(row, sampler), z, -math.inf), 0)
