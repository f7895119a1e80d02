"""`python tests/support/xla_cached_run.py CACHE_DIR REPORT.json TRAINER_ARGS...`: the trainer on XLA with
torch-xla's persistent compilation cache at CACHE_DIR, then the cache's counters written to
REPORT.json. A graph whose key is not in the cache counts as `PersistentCacheMiss`; one found counts
as a hit, or on the CPU runtime (which cannot load its compiled programs back) as
`PersistentCacheDeserializeFailure` -- either way the graph was compiled before under that key, as a
`neuron_parallel_compile` cache would hold it."""

from __future__ import annotations

import json
import sys


def main() -> None:
    cache, report, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    import torch_xla.runtime as xr

    xr.initialize_cache(cache)  # before the first graph is compiled

    from trainer.__main__ import main as trainer_main

    code = trainer_main(args)
    import torch_xla.debug.metrics as met

    counters = {name: int(met.counter_value(name) or 0) for name in met.counter_names() if "Persistent" in name}
    with open(report, "w") as f:
        json.dump(counters, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
