"""Checkpoints: a product of their own inside the library. `save` and `load` of versioned,
atomic directories in torch.distributed.checkpoint's format, background saves, the export
of full weights as safetensors; every file they read checked as data, never run.

Files, each importing only those listed before it (and the library below state_dict.py):
`files` (confined file access), `pickle_data` (pickles read as data), `manifest`
(fullshard.json's schema), `dcp_format` (DCP's files read as data), `background`
(background saves), `store` (save, load), `export` (safetensors). This file imports none
of them, so that `fullshard train`'s launcher, which needs `files` alone, imports no more;
`fullshard.save` and the others are named in fullshard/__init__.py."""
