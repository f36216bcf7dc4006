"""One node's processes (``vexpert node``): the supervisor, the coordinator, one worker per GPU, the
slot-fill protocol between them, the transports that reach the slots, the L1 slots and the L2 pool.

Modules: :mod:`.setup` (configuration checked before anything starts), :mod:`.supervisor` (processes
and the message loop) with its pieces :mod:`.balance` (load, placement, the next plan),
:mod:`.coordinator_handle` (the coordinator process seen from the supervisor), :mod:`.history` (per
iteration records, the report), :mod:`.verification`, :mod:`.config_reload` and :mod:`.processes`;
:mod:`.plans` (plans as the node serves them), :mod:`.coordinator` (pool and fill loop), :mod:`.worker` (one EP rank),
:mod:`.runners` (a worker's model work: the synthetic decode or serving), :mod:`.worker_args` (what a
worker starts with), :mod:`.protocol` (the slot handshake), :mod:`.transport`, :mod:`.slots`,
:mod:`.expert_pool`, :mod:`.messages`, :mod:`.report`, :mod:`.metrics`. The demo that drives a node
(:mod:`vexpert_runtime.demo`) and the simulation package sit outside: ``node/`` imports neither.

The public API of a node run: :func:`resolve_setup` validates a config against the machine and the
checkpoint, :func:`run_node` runs it (:class:`NodeRuntime`) with :class:`NodeOptions` and returns a
:class:`NodeReport`.
"""

from vexpert_runtime.node.report import IterationRecord, NodeOptions, NodeReport, Progress
from vexpert_runtime.node.setup import NodeSetup, resolve_setup
from vexpert_runtime.node.supervisor import NodeRuntime, install_signal_handlers, run_node

__all__ = [
    "IterationRecord",
    "NodeOptions",
    "NodeReport",
    "NodeRuntime",
    "NodeSetup",
    "Progress",
    "install_signal_handlers",
    "resolve_setup",
    "run_node",
]
