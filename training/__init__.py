"""Training of the built-in ``small`` model: a Qwen3.5 with its MTP head, from scratch, on the Python stdlib.

    python -m training --out DIR            # trains the `small` recipe (a GPU: minutes; see training/cli.py)
    python -m training --out DIR --smoke    # a CPU-sized run of the same pipeline

One module per phase, in the order ``training.pipeline.run`` calls them: ``data`` (corpus,
tokenizer, id streams, batches), ``model`` (the ``Preset`` recipe, construction, the training
forward and losses), ``train`` (the loop), ``unloop`` (the unlikelihood fine-tune against greedy
loops), ``export`` (the released checkpoint layout, put at ``--out`` by ``outdir``, which also
decides which directories a run may write), ``quality`` (measurement of the exported checkpoint,
``--measure-only``) and ``report`` (``quality.json``); ``cli`` is the command line. ``acceptance``
(MTP acceptance of a head against greedy streams) is a library that ``heads`` uses too. The
package imports ``core``, ``decoders`` (the quality phase decodes with ``serial`` and ``spec``) and
``fixtures.make_tiny`` (the checkpoint writer).
"""
