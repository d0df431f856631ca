"""transformers' ``custom_generate`` entry: ``model.generate(input_ids, custom_generate=DIR,
trust_remote_code=True, max_new_tokens=N)`` with DIR the directory above this one
(``decoders.hf_generate.CUSTOM_GENERATE_DIR``) decodes greedily with the exact ``spec`` decoder,
or with ``sampler="qwen-thinking,seed=7"`` (core.sampling's seeded sampler) exactly as serial samples."""
from decoders.hf_generate import generate  # noqa: F401 - transformers looks up `generate` here
