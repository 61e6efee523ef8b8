"""engine-testing: the test kit of the engine's own tests and of plugin authors' (the product
never imports it). Each module holds one kind of helper:

- ``checkpoints``: a tokenizer trained offline and tiny random-init HF checkpoints
  (``make_tiny_model``, ``TINY_CASES``)
- ``gguf_writer``: a checkpoint written as a GGUF file the way llama.cpp's converter does
- ``eagle_heads``: random EAGLE / EAGLE3 draft heads in SGLang's format and their plain
  torch math (``write_eagle_head``, ``reference_head``)
- ``generation``: a greedy loop over a ModelRunner and its agreement with transformers'
- ``logits``: logits against a reference's, teacher-forced logits
- ``attention``: attention backends side by side (``backend_matches_torch_native``)
- ``graphs``: ``EagerGraph``, the CUDA-graph stand-in on a CPU
- ``weights``: float weights into quantized layers, prepacked state dicts made plain
- ``servers``: ``engine serve``'s server in the test's own process
- ``invariants``: an Engine's slots and rows all free again
- ``grammar_checks``: the checks every grammar backend passes, to subclass
- ``ranks``: spawned tp/pp ranks and their HF reference
- ``fixtures``: the pytest fixtures (``pytest_plugins = ["engine_testing.fixtures"]``)
"""
