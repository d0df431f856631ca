"""Loading Qwen3.5 backbones and their MTP heads: local checkpoints and the built-in models.

``--model`` takes a checkpoint directory or a built-in name:
  small         the default: a small Qwen3.5 (8 layers, 3 Gated-DeltaNet : 1 attention, hidden 256)
                with its MTP head, TRAINED on the Python standard library (python -m
                training), committed under fixtures/small in the released layout with
                its tokenizer; real text, real acceptance, CPU-sized;
  tiny          a deterministic random Qwen3.5 committed under fixtures/tiny in the released
                multimodal layout, so loading it exercises the real checkpoint loader (fast tests);
  synthetic-9b  the Qwen3.5-9B shape (default ``Qwen3_5TextConfig``) with random bf16 weights and
                a random MTP head, built on the GPU from a seed in about a second, never on disk.

Checkpoint layouts:
  text-only   ``Qwen3_5ForCausalLM`` / ``qwen3_5_text``: ``model.*``, ``lm_head.*``, ``mtp.*``
  released    ``Qwen3_5ForConditionalGeneration`` / ``qwen3_5``: ``model.language_model.*``,
              ``lm_head.*``, ``mtp.*``, and ``model.visual.*`` (ignored)
either as one ``model.safetensors`` or sharded with ``model.safetensors.index.json``.
"""
from __future__ import annotations

import hashlib
import json
import platform
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from core.catalog import BUILTIN_MODELS, DEFAULT_MODEL  # noqa: F401 - DEFAULT_MODEL re-exported
from core.errors import UserError
from core.mtp import MTPHead

DTYPE = torch.bfloat16
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TINY_DIR = FIXTURES / "tiny"
SMALL_DIR = FIXTURES / "small"
COMMITTED = {"tiny": TINY_DIR, "small": SMALL_DIR}
SYNTHETIC_SEED = 0
# Qwen3.5's end-of-text ids (<|im_end|>, <|endoftext|>); the random 9B model keeps them.
SYNTHETIC_EOS = (248046, 248044)



@dataclass
class LoadedModel:
    """A backbone, its MTP head (or why it has none), tokenizer and identity."""

    name: str
    backbone: torch.nn.Module
    text_config: object
    device: torch.device
    eos_token_ids: tuple[int, ...]
    identity: dict
    mtp: MTPHead | None = None
    mtp_missing: str | None = None
    tokenizer: object | None = None
    extra: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def context(self) -> int | None:
        """The positions the model is made for (its config's max_position_embeddings; None where
        the config does not say): prompt + new tokens beyond it are refused, as the audit refuses
        to judge them."""
        return getattr(self.text_config, "max_position_embeddings", None)

    def check_fits(self, positions: int, what: str) -> None:
        """UserError unless ``positions`` (``what``: how they were asked for) fit the context."""
        check_fits(self.name, self.context, positions, what)

    def require_mtp(self, who: str) -> MTPHead:
        if self.mtp is None:
            raise UserError(f"decoder {who!r} needs an MTP head, but {self.name}: {self.mtp_missing}")
        return self.mtp


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(spec: str, device: str | None = None) -> LoadedModel:
    """Load a built-in model by name or a checkpoint directory by path, in bf16 on ``device``."""
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but this machine has no CUDA GPU")
    if spec == "synthetic-9b":
        return build_synthetic_9b(device)
    if spec in COMMITTED:
        model = load_checkpoint(COMMITTED[spec], device)
        model.name = spec
        model.identity["name"] = spec
        model.identity["kind"] = "builtin"
        return model
    path = Path(spec)
    if not path.exists():
        known = ", ".join(BUILTIN_MODELS)
        raise UserError(f"model {spec!r} is neither a built-in ({known}) nor an existing directory")
    return load_checkpoint(path, device)


# --------------------------------------------------------------------------- checkpoints


def read_checkpoint_config(path: Path) -> tuple[dict, str]:
    """Returns (text config dict, layout) where layout is 'text' or 'multimodal'."""
    if not path.is_dir():
        raise UserError(f"model path {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{cfg_file}: cannot parse config.json ({exc})") from None
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type == "qwen3_5" or "Qwen3_5ForConditionalGeneration" in archs:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise UserError(f"{cfg_file}: multimodal Qwen3.5 config without a text_config")
        text = dict(text)
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return text, "multimodal"
    if model_type == "qwen3_5_text" or "Qwen3_5ForCausalLM" in archs:
        return cfg, "text"
    arch = ", ".join(archs) or model_type or "unknown"
    raise UserError(
        f"{path}: architecture {arch} is not supported; expected Qwen3_5ForCausalLM (qwen3_5_text) "
        "or Qwen3_5ForConditionalGeneration (qwen3_5)"
    )


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checking an index names only files that exist."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"{index}: unreadable shard index ({exc})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise UserError(f"{path}: missing {len(missing)} of {len(shards)} shards: {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_tensors(files: list[Path], device: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with InterruptWatch() as ctrl_c:
        for f in files:
            try:
                with safe_open(str(f), framework="pt", device=str(device)) as fh:
                    for key in fh.keys():
                        tensors[key] = fh.get_tensor(key)
            except Exception as exc:  # safetensors raises several types for truncated/corrupt files
                if ctrl_c.seen:  # a Ctrl-C inside safetensors' own code can come out as another error
                    raise KeyboardInterrupt from None
                raise UserError(f"cannot read weights from {f.name}: {exc} (partial or corrupt shard?)") from None
    return tensors


class InterruptWatch:
    """Notes whether SIGINT came while the block ran (``seen``), handled as before all the same:
    a library may turn the KeyboardInterrupt raised inside it into an error of its own."""

    def __init__(self):
        self.seen = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers are the main thread's
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self.previous = previous
                signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        self.seen = True
        self.previous(signum, frame)

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


def split_weights(tensors: dict[str, torch.Tensor], layout: str):
    """Rename checkpoint keys to Qwen3_5ForCausalLM / MTPHead keys; drop vision weights."""
    backbone, mtp = {}, {}
    prefix = "model.language_model." if layout == "multimodal" else "model."
    for key, t in tensors.items():
        if key.startswith("mtp."):
            mtp[key[4:]] = t
        elif key.startswith("lm_head."):
            backbone[key] = t
        elif key.startswith(prefix):
            backbone["model." + key[len(prefix):]] = t
        # anything else (model.visual.*, unknown extras) is not part of the text backbone
    return backbone, mtp


def checkpoint_text_config(path: Path) -> tuple[Qwen3_5TextConfig, str]:
    """The checkpoint's text config as transformers builds it, and its layout; no weights read."""
    text_cfg_dict, layout = read_checkpoint_config(path)
    try:
        config = Qwen3_5TextConfig(**{k: v for k, v in text_cfg_dict.items() if k not in ("architectures", "model_type")})
    except Exception as exc:
        raise UserError(f"{path}: invalid Qwen3.5 text config ({exc})") from None
    return config, layout


def model_context(spec: str) -> int | None:
    """The context of the model ``load_model(spec)`` would load (``LoadedModel.context``), read from
    its config alone, so that a length beyond it is refused before any weights load. None where
    it cannot be known before the load (the load then says why)."""
    if spec == "synthetic-9b":
        return Qwen3_5TextConfig().max_position_embeddings
    path = COMMITTED.get(spec, Path(spec))
    if not path.is_dir():
        return None
    return getattr(checkpoint_text_config(path)[0], "max_position_embeddings", None)


def check_fits(name: str, context: int | None, positions: int, what: str) -> None:
    """UserError unless ``positions`` (``what``: how they were asked for) fit ``context``."""
    if context is not None and positions > context:
        raise UserError(f"{what} = {positions} positions, beyond model {name}'s context of {context}")


def load_checkpoint(path: Path, device: str) -> LoadedModel:
    config, layout = checkpoint_text_config(path)
    files = checkpoint_files(path)
    tensors = read_tensors(files, device)
    backbone_sd, mtp_sd = split_weights(tensors, layout)
    del tensors
    if "lm_head.weight" not in backbone_sd and config.tie_word_embeddings:
        backbone_sd["lm_head.weight"] = backbone_sd.get("model.embed_tokens.weight")

    with torch.device(device):
        backbone = Qwen3_5ForCausalLM._from_config(config, dtype=DTYPE)
    expected = set(backbone.state_dict().keys())
    missing = sorted(expected - set(backbone_sd))
    if missing:
        raise UserError(
            f"{path}: checkpoint lacks {len(missing)} backbone tensors (e.g. {missing[0]}); partial download?"
        )
    load_exact(backbone, backbone_sd, str(path))
    backbone.eval()

    mtp, why = None, None
    if not mtp_sd:
        why = "the checkpoint has no mtp.* weights (serial decoding still works)"
    else:
        with torch.device(device):
            head = MTPHead(config).to(DTYPE)
        need = set(head.state_dict().keys())
        lacking = sorted(need - set(mtp_sd))
        if lacking:
            why = f"the checkpoint's MTP head is incomplete (lacks mtp.{lacking[0]} and {len(lacking) - 1} more)"
        else:
            load_exact(head, {k: mtp_sd[k] for k in need}, str(path) + " (mtp)")
            mtp = head.eval()

    identity = {
        "name": str(path.resolve()),
        "kind": "checkpoint",
        "layout": layout,
        "config_sha256": sha256_json(json.loads((path / "config.json").read_text())),
        "weights_fingerprint": weights_fingerprint(backbone, mtp),
    }
    return LoadedModel(
        name=str(path),
        backbone=backbone,
        text_config=config,
        device=torch.device(device),
        eos_token_ids=eos_ids(path, config),
        identity=identity,
        mtp=mtp,
        mtp_missing=why,
        tokenizer=TokenizerRef(path),
        extra={"checkpoint_dir": str(path.resolve())},
    )


def load_exact(module: torch.nn.Module, sd: dict, where: str) -> None:
    own = module.state_dict()
    for key, t in sd.items():
        if key in own and tuple(own[key].shape) != tuple(t.shape):
            raise UserError(f"{where}: tensor {key} has shape {tuple(t.shape)}, config says {tuple(own[key].shape)}")
    module.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=True)


def eos_ids(path: Path, config) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    value = None
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            value = None
    if value is None:
        value = config.eos_token_id
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class TokenizerRef:
    """Loads the checkpoint's tokenizer on first use, so token-id prompts need none."""

    def __init__(self, path: Path):
        self.path = path
        self._tok = None

    def get(self):
        if self._tok is None:
            # transformers 5 builds an empty tokenizer (no vocabulary) from a directory without
            # tokenizer files instead of failing; every text would then encode to nothing.
            if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
                raise UserError(f"{self.path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                                "copy them from the release or give prompts as token_ids")
            try:
                self._tok = AutoTokenizer.from_pretrained(str(self.path))
            except Exception as exc:
                raise UserError(f"{self.path}: cannot load its tokenizer ({exc}); give prompts as token_ids") from None
        return self._tok


# --------------------------------------------------------------------------- synthetic-9b


def build_synthetic_9b(device: str, seed: int = SYNTHETIC_SEED) -> LoadedModel:
    if not str(device).startswith("cuda"):
        raise UserError("synthetic-9b is built on a GPU and needs CUDA; on a CPU use --model tiny")
    config = Qwen3_5TextConfig(eos_token_id=list(SYNTHETIC_EOS))
    torch.manual_seed(seed)
    with torch.device(device):
        backbone = Qwen3_5ForCausalLM._from_config(config, dtype=DTYPE).eval()
        head = MTPHead(config).to(DTYPE)
    init_random_head(head, seed)
    identity = {
        "name": "synthetic-9b",
        "kind": "builtin",
        "seed": seed,
        "config_sha256": sha256_json(config.to_dict()),
        "weights_fingerprint": weights_fingerprint(backbone, head),
    }
    return LoadedModel(
        name="synthetic-9b",
        backbone=backbone,
        text_config=config,
        device=torch.device(device),
        eos_token_ids=SYNTHETIC_EOS,
        identity=identity,
        mtp=head.eval(),
        tokenizer=None,
    )


@torch.no_grad()
def init_random_head(head: MTPHead, seed: int, std: float = 0.02, norm_std: float = 0.0) -> None:
    """Deterministic initialisation of an MTP head, the same on every device for a seed."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in sorted(head.named_parameters()):
        if p.ndim >= 2:
            vals = torch.randn(p.shape, generator=gen) * std
        elif name.endswith("A_log"):
            vals = torch.rand(p.shape, generator=gen).mul(15.99).add(0.01).log()
        else:
            vals = torch.randn(p.shape, generator=gen) * norm_std
        p.copy_(vals.to(p.dtype))


# --------------------------------------------------------------------------- identity


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@torch.no_grad()
def tensor_fingerprint(t: torch.Tensor, chunk: int = 1 << 26) -> int:
    """Position-weighted sum of the tensor's raw bits in int64 (wrapping). Integer addition is
    associative, so the value is the same on every device and in every reduction order."""
    flat = t.detach().reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        bits = flat.view(torch.int16)
    elif flat.dtype == torch.float32:
        bits = flat.view(torch.int32)
    else:
        bits = flat.to(torch.int64)
    total = 0
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        idx = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        weight = (idx * 2654435761 + 97) % 2147483647
        total += int((part * weight).sum().item())
    return total % (1 << 64)


def weights_fingerprint(*modules) -> str:
    h = hashlib.sha256()
    for prefix, module in zip(("backbone", "mtp"), modules):
        if module is None:
            continue
        for name, t in sorted(module.state_dict().items()):
            h.update(f"{prefix}.{name}:{tuple(t.shape)}:{t.dtype}:{tensor_fingerprint(t)};".encode())
    return h.hexdigest()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"
