"""The checkpoint loader: both layouts round-trip bit for bit, and every bad input is one clear line.

The round trips rewrite the built-in ``tiny`` checkpoint (released multimodal layout, two shards)
as the text-only layout (single file and sharded) and as an unsharded multimodal checkpoint, load
each, and compare every backbone and MTP tensor with the built-in. The error cases run the real
CLI (``harness time --model DIR``) and check the contract: exit code 2, one ``error:`` line, no
traceback, nothing written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from harness.cli import main
from core.errors import UserError
from core.models import TINY_DIR, load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROGRESS_PREFIXES = ("loading model ", "timing ")


# --------------------------------------------------------------------------- helpers


def tiny_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the built-in tiny checkpoint, read straight from its shards."""
    index = json.loads((TINY_DIR / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(TINY_DIR / shard), framework="pt") as fh:
            for key in fh.keys():
                out[key] = fh.get_tensor(key)
    return out


def tiny_config() -> dict:
    return json.loads((TINY_DIR / "config.json").read_text())


def to_text_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.language_model.* -> model.*, lm_head.* and mtp.* kept, model.visual.* dropped."""
    out = {}
    for key, t in tensors.items():
        if key.startswith("model.language_model."):
            out["model." + key[len("model.language_model."):]] = t
        elif key.startswith(("lm_head.", "mtp.")):
            out[key] = t
        else:
            assert key.startswith("model.visual."), key
    return out


def text_config() -> dict:
    cfg = dict(tiny_config()["text_config"])
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    cfg["model_type"] = "qwen3_5_text"
    return cfg


def write_checkpoint(out: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
                     tokenizer: bool = True, generation_config: bool = True) -> Path:
    """Write a checkpoint directory: one model.safetensors (shards=1) or ``shards`` files + index."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config:
        shutil.copy(TINY_DIR / "generation_config.json", out / "generation_config.json")
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(TINY_DIR / name, out / name)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        return out
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


def assert_same_weights(model, reference) -> None:
    """Every backbone and MTP tensor bit-identical to the reference model's."""
    got, want = model.backbone.state_dict(), reference.backbone.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype == torch.bfloat16, key
        assert torch.equal(bits(got[key]), bits(want[key])), f"backbone tensor {key} differs"
    assert model.mtp is not None, model.mtp_missing
    got, want = model.mtp.state_dict(), reference.mtp.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(bits(got[key]), bits(want[key])), f"mtp tensor {key} differs"
    assert model.identity["weights_fingerprint"] == reference.identity["weights_fingerprint"]


def run_cli(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=True)


def assert_user_error(result, out_dir: Path, *needles: str) -> str:
    """The CLI's contract for a user mistake: exit 2, exactly one ``error:`` line (the last line of
    stderr; any other lines are the progress lines printed before it), no traceback, no output."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(ln.startswith(PROGRESS_PREFIXES) for ln in lines[:-1]), result.stderr
    assert "Traceback" not in result.output
    if out_dir.exists():
        assert list(out_dir.iterdir()) == [], f"{out_dir} has {list(out_dir.iterdir())}"
    message = errors[0]
    for needle in needles:
        assert needle.lower() in message.lower(), f"{needle!r} not in {message!r}"
    return message


def time_args(model: str, out: Path, *extra: str) -> list[str]:
    return ["time", "--model", model, "--decoder", "serial", "--limit", "1", "-n", "2", "--legs", "1",
            "--warmup-tokens", "0", "--out", str(out), *extra]


# --------------------------------------------------------------------------- round trips


@pytest.fixture(scope="module")
def tensors():
    return tiny_tensors()


def test_tiny_builtin_is_multimodal_and_sharded(tiny, tensors):
    assert tiny.identity["layout"] == "multimodal"
    assert tiny.identity["kind"] == "builtin"
    assert len(set(json.loads((TINY_DIR / "model.safetensors.index.json").read_text())["weight_map"].values())) == 2
    assert any(k.startswith("model.visual.") for k in tensors)
    assert not any("visual" in k for k in tiny.backbone.state_dict())
    assert tiny.mtp is not None and tiny.mtp_missing is None
    # every checkpoint tensor except the vision tower went somewhere, bit for bit
    sd = tiny.backbone.state_dict()
    msd = tiny.mtp.state_dict()
    for key, t in tensors.items():
        if key.startswith("model.visual."):
            continue
        if key.startswith("mtp."):
            mine = msd[key[4:]]
        elif key.startswith("lm_head."):
            mine = sd[key]
        else:
            mine = sd["model." + key[len("model.language_model."):]]
        assert torch.equal(bits(mine), bits(t)), key
    n_ckpt = sum(1 for k in tensors if not k.startswith("model.visual."))
    assert n_ckpt == len(sd) + len(msd)


@pytest.mark.parametrize("shards", [1, 3], ids=["single-file", "sharded"])
def test_text_layout_round_trip(tmp_path, tiny, tiny_tokenizer, tensors, shards):
    path = write_checkpoint(tmp_path / "ckpt", text_config(), to_text_layout(tensors), shards=shards)
    assert (path / "model.safetensors.index.json").exists() == (shards > 1)
    model = load_model(str(path), "cpu")
    assert model.identity["layout"] == "text"
    assert model.identity["kind"] == "checkpoint"
    assert_same_weights(model, tiny)
    assert model.eos_token_ids == tiny.eos_token_ids == (2, 0)
    assert model.vocab_size == tiny.vocab_size
    tok = model.tokenizer.get()
    text = "def merge_sorted(a, b):\n    result = []"
    assert tok.encode(text) == tiny_tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_multimodal_layout_unsharded_round_trip(tmp_path, tiny, tensors):
    assert any(k.startswith("model.visual.") for k in tensors)
    path = write_checkpoint(tmp_path / "mm", tiny_config(), tensors, shards=1)
    model = load_model(str(path), "cpu")
    assert model.identity["layout"] == "multimodal"
    assert_same_weights(model, tiny)
    assert not any("visual" in k for k in model.backbone.state_dict())
    assert model.eos_token_ids == (2, 0)
    # same checkpoint config file => same config hash as the built-in
    assert model.identity["config_sha256"] == tiny.identity["config_sha256"]


def test_round_trip_model_decodes_like_builtin(tmp_path, tiny, tensors):
    from decoders.serial import SerialDecoder

    path = write_checkpoint(tmp_path / "ckpt", text_config(), to_text_layout(tensors), shards=2)
    model = load_model(str(path), "cpu")
    prompt = [319, 284, 75, 404, 289, 345]
    a, b = SerialDecoder(), SerialDecoder()
    a.prepare(tiny)
    b.prepare(model)
    assert a.decode(prompt, 12).tokens == b.decode(prompt, 12).tokens


def test_eos_ids_fall_back_to_config(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "ckpt", text_config(), to_text_layout(tensors), generation_config=False)
    assert load_model(str(path), "cpu").eos_token_ids == (2, 0)
    cfg = text_config()
    cfg["eos_token_id"] = 7
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(path), "cpu").eos_token_ids == (7,)


def test_checkpoint_without_mtp_loads_backbone(tmp_path, tiny, tensors):
    no_mtp = {k: v for k, v in to_text_layout(tensors).items() if not k.startswith("mtp.")}
    model = load_model(str(write_checkpoint(tmp_path / "ckpt", text_config(), no_mtp)), "cpu")
    assert model.mtp is None
    assert "no mtp" in model.mtp_missing.lower()
    with pytest.raises(UserError, match="MTP head"):
        model.require_mtp("spec-naive")
    sd, ref = model.backbone.state_dict(), tiny.backbone.state_dict()
    assert all(torch.equal(bits(sd[k]), bits(ref[k])) for k in ref)


def test_incomplete_mtp_head_is_reported(tmp_path, tensors):
    partial = {k: v for k, v in to_text_layout(tensors).items() if k != "mtp.fc.weight"}
    model = load_model(str(write_checkpoint(tmp_path / "ckpt", text_config(), partial)), "cpu")
    assert model.mtp is None
    assert "incomplete" in model.mtp_missing and "mtp.fc.weight" in model.mtp_missing


# --------------------------------------------------------------------------- loader errors via the CLI


def _bad_dir(tmp_path: Path, tensors, case: str) -> Path:
    ckpt = tmp_path / "ckpt"
    text = to_text_layout(tensors)
    if case == "nonexistent":
        return tmp_path / "does-not-exist"
    if case == "file":
        f = tmp_path / "model.safetensors"
        f.write_bytes(b"not a directory")
        return f
    if case == "no-config":
        write_checkpoint(ckpt, text_config(), text)
        (ckpt / "config.json").unlink()
    elif case == "bad-config-json":
        write_checkpoint(ckpt, text_config(), text)
        (ckpt / "config.json").write_text('{"model_type": "qwen3_5_text", ')
    elif case == "wrong-architecture":
        write_checkpoint(ckpt, {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                "hidden_size": 64, "vocab_size": 512}, text)
    elif case == "multimodal-without-text-config":
        cfg = tiny_config()
        del cfg["text_config"]
        write_checkpoint(ckpt, cfg, tensors)
    elif case == "missing-shard":
        write_checkpoint(ckpt, text_config(), text, shards=3)
        (ckpt / "model-00002-of-00003.safetensors").unlink()
    elif case == "bad-index":
        write_checkpoint(ckpt, text_config(), text, shards=2)
        (ckpt / "model.safetensors.index.json").write_text("{not json")
    elif case == "no-weights":
        write_checkpoint(ckpt, text_config(), text)
        (ckpt / "model.safetensors").unlink()
    elif case == "truncated-shard":
        write_checkpoint(ckpt, text_config(), text, shards=2)
        shard = ckpt / "model-00001-of-00002.safetensors"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif case == "corrupt-header":
        write_checkpoint(ckpt, text_config(), text)
        shard = ckpt / "model.safetensors"
        data = bytearray(shard.read_bytes())
        data[8:40] = b"\xff" * 32  # the JSON header right after the 8-byte length
        shard.write_bytes(bytes(data))
    elif case == "partial-backbone":
        drop = [k for k in text if k.startswith("model.layers.2.")]
        assert drop
        write_checkpoint(ckpt, text_config(), {k: v for k, v in text.items() if k not in drop})
    elif case == "shape-mismatch":
        cfg = text_config()
        cfg["intermediate_size"] = 96
        write_checkpoint(ckpt, cfg, text)
    elif case == "invalid-text-config":
        cfg = text_config()
        cfg["layer_types"] = ["no_such_layer"] * 4
        write_checkpoint(ckpt, cfg, text)
    elif case == "no-tokenizer":
        write_checkpoint(ckpt, text_config(), text, tokenizer=False)
    else:
        raise AssertionError(case)
    return ckpt


LOADER_ERRORS = {
    # case: words the one error line must contain
    "nonexistent": ("neither a built-in", "does-not-exist"),
    "file": ("not a directory",),
    "no-config": ("no config.json",),
    "bad-config-json": ("cannot parse config.json",),
    "wrong-architecture": ("LlamaForCausalLM", "not supported"),
    "multimodal-without-text-config": ("text_config",),
    "missing-shard": ("missing 1 of 3 shards", "model-00002-of-00003.safetensors"),
    "bad-index": ("shard index",),
    "no-weights": ("no model.safetensors",),
    "truncated-shard": ("model-00001-of-00002.safetensors", "corrupt"),
    "corrupt-header": ("model.safetensors", "corrupt"),
    "partial-backbone": ("lacks", "backbone tensors", "model.layers.2."),
    "shape-mismatch": ("shape",),
    "invalid-text-config": ("config",),
    "no-tokenizer": ("tokenizer", "token_ids"),
}


@pytest.mark.parametrize("case", sorted(LOADER_ERRORS))
def test_loader_error_is_one_line(tmp_path, tensors, case):
    model_dir = _bad_dir(tmp_path, tensors, case)
    out = tmp_path / "out"
    result = run_cli(time_args(str(model_dir), out))
    assert_user_error(result, out, *LOADER_ERRORS[case])


def test_no_mtp_serial_runs_spec_naive_refuses(tmp_path, tensors):
    no_mtp = {k: v for k, v in to_text_layout(tensors).items() if not k.startswith("mtp.")}
    ckpt = write_checkpoint(tmp_path / "ckpt", text_config(), no_mtp, shards=2)
    ok = tmp_path / "ok"
    result = run_cli(time_args(str(ckpt), ok))
    assert result.exit_code == 0, result.output
    assert (ok / "stream.jsonl").is_file()
    header = json.loads((ok / "stream.jsonl").read_text().splitlines()[0])
    assert header["model"]["kind"] == "checkpoint" and header["model"]["layout"] == "text"

    out = tmp_path / "refused"
    args = time_args(str(ckpt), out)
    args[args.index("serial")] = "spec-naive"
    msg = assert_user_error(run_cli(args), out, "spec-naive", "MTP head", "no mtp.* weights")
    assert "serial decoding still works" in msg


def test_synthetic_9b_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    assert_user_error(run_cli(time_args("synthetic-9b", out)), out, "synthetic-9b", "CUDA", "--model tiny")


def test_device_cuda_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    assert_user_error(run_cli(time_args("tiny", out, "--device", "cuda")), out, "cuda", "no CUDA GPU")


# --------------------------------------------------------------------------- bad prompt files


PROMPT_ERRORS = {
    # case: (file content or None for a missing file, words in the error line)
    "missing-file": (None, ("not found",)),
    "invalid-json": ('{"id": "a", "text": "hello"}\n{"id": "b", "text": \n', (":2:", "not valid JSON")),
    "not-an-object": ('["a", "b"]\n', (":1:", "JSON object")),
    "empty-file": ("\n\n", ("no prompts",)),
    "duplicate-id": ('{"id": "a", "text": "hello"}\n{"id": "a", "text": "again"}\n', (":2:", "duplicate", "'a'")),
    "missing-id": ('{"text": "hello"}\n', ("id",)),
    "both-text-and-ids": ('{"id": "a", "text": "hi", "token_ids": [1, 2]}\n', ("exactly one of",)),
    "neither-text-nor-ids": ('{"id": "a"}\n', ("exactly one of",)),
    "id-outside-vocab": ('{"id": "a", "token_ids": [5, 512]}\n', ("token id 512", "outside the vocabulary", "0..511")),
    "negative-id": ('{"id": "a", "token_ids": [-1]}\n', ("token id -1", "outside")),
    "empty-token-ids": ('{"id": "a", "token_ids": []}\n', ("non-empty list",)),
    "non-integer-ids": ('{"id": "a", "token_ids": [1, "2"]}\n', ("list of integers",)),
    "empty-text": ('{"id": "a", "text": ""}\n', ("non-empty string",)),
}


@pytest.mark.parametrize("case", sorted(PROMPT_ERRORS))
def test_bad_prompt_file_is_one_line(tmp_path, case):
    content, needles = PROMPT_ERRORS[case]
    prompts = tmp_path / "prompts.jsonl"
    if content is not None:
        prompts.write_text(content)
    out = tmp_path / "out"
    result = run_cli(time_args("tiny", out, "--prompts", str(prompts)))
    assert_user_error(result, out, *needles)


def test_token_id_prompt_file_works(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "ids", "token_ids": [319, 284, 75, 404]}\n\n{"id": "txt", "text": "Dear Margaret"}\n')
    out = tmp_path / "out"
    result = run_cli(time_args("tiny", out, "--prompts", str(prompts), "--limit", "2"))  # last --limit wins
    assert result.exit_code == 0, result.output
    recs = [json.loads(x) for x in (out / "stream.jsonl").read_text().splitlines()]
    got = [(r["id"], r["token_ids"], r["text"]) for r in recs if r["type"] == "prompt"]
    assert got[0] == ("ids", [319, 284, 75, 404], None)
    assert got[1][0] == "txt" and got[1][2] == "Dear Margaret"
    assert recs[0]["prompts"]["source"] == str(prompts)


def test_cli_error_through_real_console_script(tmp_path):
    """One end-to-end process run: the installed ``harness`` entry point prints one line, exit 2."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *time_args(str(tmp_path / "nope"), out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # tiny model: threads only contend
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "neither a built-in" in lines[-1]
    assert [ln for ln in lines if ln.startswith("error:")] == [lines[-1]]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()


def test_small_is_the_trained_default_with_its_head_and_prompts():
    """The built-in default is the committed trained model: released layout, MTP head present,
    its own tokenizer, and the stdlib held-out prompts as its default set."""
    from core.models import DEFAULT_MODEL, load_model
    from core.prompts import default_prompt_set, load_prompts

    assert DEFAULT_MODEL == "small"
    model = load_model("small", "cpu")
    assert model.identity["kind"] == "builtin" and model.identity["layout"] == "multimodal"
    assert model.mtp is not None and model.vocab_size == 4096
    assert default_prompt_set(model) == "stdlib-heldout"
    prompts, info = load_prompts(None, model)
    assert info["source"] == "builtin:stdlib-heldout" and len(prompts) == 10
    assert all(p.text and p.token_ids for p in prompts)
    text = model.tokenizer.get().decode(prompts[0].token_ids)
    assert text == prompts[0].text  # byte-level BPE round-trips the source text


def test_a_ctrl_c_inside_the_weight_reader_is_an_interrupt_not_a_corrupt_shard(tmp_path, tensors, monkeypatch):
    """safetensors may turn the KeyboardInterrupt a Ctrl-C raises inside it into an error of its
    own; the loader must still call it an interrupt, not blame the file."""
    import signal

    from core import models

    path = write_checkpoint(tmp_path / "ckpt", text_config(), to_text_layout(tensors))
    real_open = models.safe_open

    class InterruptedReader:
        def __init__(self, *args, **kwargs):
            self.fh = real_open(*args, **kwargs)

        def __enter__(self):
            self.fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

        def keys(self):
            return self.fh.keys()

        def get_tensor(self, key):
            try:
                signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, mid-read
                return self.fh.get_tensor(key)
            except KeyboardInterrupt:
                raise RuntimeError("read interrupted") from None  # as a library's own error

    monkeypatch.setattr(models, "safe_open", InterruptedReader)
    # Python's own handler, whatever this process inherited (a shell's background job ignores SIGINT)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            models.read_tensors(models.checkpoint_files(path), "cpu")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was
    finally:
        signal.signal(signal.SIGINT, inherited)
