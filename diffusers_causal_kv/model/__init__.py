"""The model layer: what the cache needs to know of a transformer and the hooks that run it.

* :mod:`.topology`: branches, attention modules, model kind, the state of the K/V projections;
* :mod:`.install`: engine maps, registration, hooks, ``clear_caches`` / ``uninstall_causal_kv``;
* :mod:`.hook`: the transformer-level hook (validate, describe, run, commit each forward under a context);
* :mod:`.forward_pass`: the record of one forward, its staging and the two-phase commit;
* :mod:`.validation`: every pre-flight check, for forwards and for rollouts;
* :mod:`.checkpointing`: gradient checkpointing that recomputes under the forward's own pass.
"""

from .forward_pass import commits_together
from .install import clear_caches, prepare_transformer, resolve_engines, uninstall_causal_kv
from .topology import experts_of, topology
from .validation import check_forward_inputs, check_rollout

__all__ = [
    "check_forward_inputs",
    "check_rollout",
    "clear_caches",
    "commits_together",
    "experts_of",
    "prepare_transformer",
    "resolve_engines",
    "topology",
    "uninstall_causal_kv",
]
