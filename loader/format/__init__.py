"""The on-disk formats: safetensors headers and writing, compressed-tensor metadata, the manifest, discovery.

- :mod:`.safetensors`: parse and validate headers strictly, write aligned files (``AlignedWriter``);
- :mod:`.compression`: the ``gdsload.compression`` metadata of compressed tensors;
- :mod:`.manifest`: ``gdsload.json``, the manifest of a sharded directory;
- :mod:`.discovery`: which files a tensor-parallel rank loads.
"""
