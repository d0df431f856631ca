"""The recipe (``Preset``, ``PRESETS``) and the model: construction, the training forward and its losses.

The backbone is HF's own ``Qwen3_5ForCausalLM`` (its ``model`` then ``lm_head``, as its forward does;
the chunked Gated-DeltaNet rule); the MTP head is ``core.mtp.MTPHead`` run over the whole window
with its causal mask (``mtp_rows``). Residual dropout is added by forward hooks in training mode only
(``add_dropout``), so the modules' own code is unchanged and an exported checkpoint holds weights only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

from core.errors import UserError
from core.models import load_model
from core.mtp import MTPHead


@dataclass(frozen=True)
class Preset:
    """One training recipe; ``dataclasses.replace`` makes the command line's overrides."""

    name: str
    vocab: int              # tokenizer ids (BPE trained on the train split)
    model: dict             # Qwen3_5TextConfig arguments besides vocab and special ids
    seq_len: int            # tokens per training row
    batch: int              # rows per step
    steps: int | None       # optimizer steps (the LR schedule's length); None: planned at run time
    lr: float               # peak learning rate (after the warmup)
    warmup: int             # linear-warmup steps
    max_epochs: float = 32.0     # planned steps never exceed this many passes over the train split
    calib_steps: int = 30        # with steps=None and a time cap: steps 10..calib_steps time the plan
    dropout: float = 0.1         # on every layer's mixer and MLP output, training only (add_dropout)
    min_lr_frac: float = 0.1     # the cosine decays to this fraction of lr
    weight_decay: float = 0.1    # AdamW, matrices only
    mtp_lambda: float = 0.3      # loss = next-token CE + mtp_lambda x MTP CE
    grad_clip: float = 1.0
    eval_every: int = 250        # steps between dev evaluations
    eval_windows: int = 256      # dev windows per evaluation (cap)
    heldout_windows: int = 1024  # held-out windows (cap)
    prompts: int = 24            # held-out prompts for samples and acceptance
    prompts_per_file: int = 2
    prompt_len: int = 64         # prompt ids of the quality phase (and of the unloop rounds)
    new_tokens: int = 96         # greedy tokens per prompt there
    depth: int = 4               # draft depth of the acceptance measurement and the spec check
    samples: int = 8             # greedy samples written to quality.json
    log_every: int = 50
    corpus_bytes: dict | None = None  # per-split byte budget (smoke runs only)
    # Sequence-level unlikelihood fine-tune after training (``unloop``; 0 updates: none): the
    # model's own greedy continuations of train-split prompts, each token that completes an
    # ``unloop_ngram``-gram already in its sequence penalised by -log(1 - p), beside ordinary
    # next-token + MTP batches so the language model itself is kept.
    unloop_steps: int = 0
    unloop_lr: float = 1e-4
    unloop_weight: float = 1.0
    unloop_ngram: int = 8             # 8-grams: 3.8 % of real dev code tokens repeat one (4-grams: 12 %)
    unloop_prompts: int = 256         # continuations generated per round
    unloop_every: int = 16            # updates per round of generation
    unloop_batch: int = 32            # generated sequences per update
    unloop_mle_batch: int = 8         # train windows per update


def _rope(head_dim: int, partial: float = 0.25, theta: float = 10000.0) -> dict:
    """Qwen3.5's partial, interleaved M-RoPE (text positions make it plain RoPE); the three
    sections cover the rotary half-dimension as in the release ([11, 11, 10] for 64 pairs)."""
    pairs = int(head_dim * partial) // 2
    a = round(pairs * 11 / 32)
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial,
            "mrope_section": [a, a, pairs - 2 * a], "mrope_interleaved": True}


# Qwen3.5-9B's ratios at hidden 256: 3 Gated-DeltaNet : 1 gated attention (full_attention_interval 4),
# attention heads x head_dim = hidden, 2 KV groups, linear value heads = 2 x key heads with
# value width = hidden and key width = hidden / 2, MLP 3 x hidden, untied lm_head, one MTP layer.
# Differences: head_dim 64 (not 256) and RoPE theta 1e4 (not 1e7), for 1024-token training windows.
# 8.94M backbone + 0.98M head parameters: 19.87 MB of bf16 safetensors.
SMALL_MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=4096,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    rope_parameters=_rope(64),
)

SMOKE_MODEL = dict(SMALL_MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, rope_parameters=_rope(16))

PRESETS = {
    # fixtures/small's recipe. Its dropout, weight decay and unloop fine-tune are choices made on dev
    # loss and on how many dev prompts loop under greedy decoding; held-out takes part in no choice.
    "small": Preset(name="small", vocab=4096, model=SMALL_MODEL, seq_len=1024, batch=32, steps=None, lr=2e-3,
                    warmup=100, dropout=0.2, weight_decay=0.3, unloop_steps=300, unloop_lr=3e-4),
    "smoke": Preset(name="smoke", vocab=512, model=SMOKE_MODEL, seq_len=64, batch=4, steps=8, lr=3e-3, warmup=2,
                    calib_steps=0,
                    eval_every=4, eval_windows=4, heldout_windows=4, prompts=2, prompts_per_file=1, prompt_len=16,
                    new_tokens=12, depth=4, samples=2, log_every=2,
                    unloop_ngram=2, unloop_prompts=8, unloop_every=2, unloop_batch=4, unloop_mle_batch=2,
                    corpus_bytes={"train": 150_000, "dev": 20_000, "heldout": 40_000}),
}


# --------------------------------------------------------------------------- construction


def text_config(preset: Preset, eos_ids: list[int], pad_id: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**preset.model, vocab_size=preset.vocab, eos_token_id=list(eos_ids), pad_token_id=pad_id)


def build_models(cfg, seed: int):
    """Backbone (HF's init under ``seed``) and MTP head (normal(0, initializer_range) matrices,
    zero-centred norms at 0, i.e. scale 1), both fp32 on the CPU: the same init on every device."""
    torch.manual_seed(seed)
    backbone = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32)
    head = MTPHead(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(head.named_parameters()):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
            else:  # the head's vectors are all zero-centred RMSNorm weights (one full-attention layer)
                p.zero_()
    return backbone, head


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def require_checkpoint(ckpt: Path) -> None:
    if not (ckpt / "tokenizer.json").is_file() or not (ckpt / "config.json").is_file():
        raise UserError(f"{ckpt} is not a checkpoint directory (no tokenizer.json/config.json)")


def load_for_training(ckpt: Path):
    """(config, fp32 backbone, fp32 MTP head) from an exported checkpoint (``--init-from``)."""
    require_checkpoint(ckpt)
    model = load_model(str(ckpt), "cpu")
    if model.mtp is None:
        raise UserError(f"{ckpt} has no usable MTP head: {model.mtp_missing}")
    return model.text_config, model.backbone.float(), model.mtp.float()


# --------------------------------------------------------------------------- training forward


def add_dropout(modules, p: float) -> list:
    """Residual dropout for training: forward hooks that drop out each decoder layer's token-mixer
    (Gated-DeltaNet or attention) and MLP output before the residual add, in training mode only.
    The modules' own code runs unchanged; in eval mode (and in the exported checkpoint, which holds
    weights only) the hooks do nothing. Returns the hook handles."""

    def hook(mod, args, output):
        if not mod.training or p <= 0:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, training=True),) + tuple(output[1:])
        return F.dropout(output, p, training=True)

    handles = []
    for m in modules:
        for layer in m.modules():
            if isinstance(layer, Qwen3_5DecoderLayer):
                mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn
                handles += [mixer.register_forward_hook(hook), layer.mlp.register_forward_hook(hook)]
    return handles


def mtp_rows(backbone, head, ids: torch.Tensor, detach_hidden: bool = False):
    """The training forward. ids [B, T] -> (post-norm hidden [B, T, H], head output [B, T-2, H]).

    Head row t (t = 0..T-3) is ``MTPHead.forward`` on (hidden h_t after the backbone's final norm,
    token ids[t+1]) at RoPE position t, causal over rows 0..t: the row a persistent head cache
    holds for position t at inference. ``lm_head`` of row t predicts ids[t+2]. The hidden state is
    not detached unless asked: the head's loss also trains the backbone, as in DeepSeek-V3's MTP."""
    T = ids.shape[1]
    hidden = backbone.model(input_ids=ids, use_cache=False).last_hidden_state
    h = hidden[:, : T - 2]
    if detach_hidden:
        h = h.detach()
    out = head(h, ids[:, 1: T - 1], torch.arange(T - 2, device=ids.device), backbone)
    return hidden, out


def losses(backbone, head, ids: torch.Tensor, detach_hidden: bool = False):
    """(next-token CE, MTP CE for t+2), means over all rows of the batch, in fp32."""
    hidden, out = mtp_rows(backbone, head, ids, detach_hidden)
    V = backbone.config.vocab_size
    logits = backbone.lm_head(hidden[:, :-1])
    ntp = F.cross_entropy(logits.float().reshape(-1, V), ids[:, 1:].reshape(-1))
    mtp_logits = backbone.lm_head(out)
    mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), ids[:, 2:].reshape(-1))
    return ntp, mtp
