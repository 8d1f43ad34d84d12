"""What runs a compiled model without torch and without TVM's compiler library.

    m = hla_tvm.runtime.load("model.so")
    state = m.init_state(batch)
    logits, state = m.prefill(tokens [B, T], state)      # numpy (or torch) in, numpy out
    logits, state = m.decode(tokens [B], state)

- `model`: `load` / `CompiledModel` (prefill, decode, the state and its files), `read_meta`;
- `libfile`: the sealed library format (checksum trailer, metadata note), checked before loading;
- `device_code`: CUDA device code built with nvcc and served to TVM when a module loads;
- `generate`: the sampling loop and the byte-level text vocabulary;
- `pool`: TVM's CPU worker pool, the worker count chosen per call, the machine's load;
- `cache`: the cache folder (its layout, privacy and clearing);
- `paths`: the checks of written paths and the one way every file is written.

Nothing here imports torch or TVM's compiler (`tests/test_runtime_package.py` imports every
module where neither can be imported)."""
from .model import (
                    META_FUNC,
                    MODULE_FORMAT,
                    PREFILL_PIECE,
                    STATE_MODEL,
                    CompiledModel,
                    last_position,
                    load,
                    prefill_pieces,
                    read_meta,
)
from .pool import physical_cores, set_threads

__all__ = ["CompiledModel", "META_FUNC", "MODULE_FORMAT", "PREFILL_PIECE", "STATE_MODEL",
           "last_position", "load", "physical_cores", "prefill_pieces", "read_meta",
           "set_threads"]
