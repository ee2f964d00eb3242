"""Exceptions raised by treedec for bad input.

Every error says which argument was wrong, what was expected and what was given. An
operation that raises leaves the tree and the KV pool exactly as they were.
"""


class TreeError(ValueError):
    """An invalid tree operation: unknown node, cycle, extending a non-leaf, ..."""


class PoolExhaustedError(RuntimeError):
    """The paged KV pool has fewer free pages than an operation needs."""


class PlanError(ValueError):
    """A tree layout or planner configuration that cannot be planned."""


class BackendUnavailableError(RuntimeError):
    """An attention backend was requested that cannot run on this machine."""


class ControllerError(ValueError):
    """A branch controller returned an invalid operation list (see :mod:`treedec.programs.controller`)."""


class ConcurrentUseError(RuntimeError):
    """A second thread entered an engine or tree that another thread is using (one engine per thread)."""


class RecordingError(RuntimeError):
    """An engine run that a :class:`~treedec.replay.ScheduleRecorder` cannot write as a replay schedule, or a
    recorder used wrongly (a second one on an engine, a wrapper of its methods left at close). The call that
    raises it changes nothing."""


class CheckpointError(ValueError):
    """A malformed checkpoint (a folder's config, index, shard or tensor; an EAGLE checkpoint; a GGUF file).

    The message names the file (and the key or tensor), the expected and the actual value.
    """


class ModelUnavailableError(RuntimeError):
    """A known model (:data:`~treedec.models.catalog.KNOWN_MODELS`) cannot be fetched here: no network, no pip, a
    package index that refuses. The message says why and what to run."""


class UnsupportedModelError(ValueError, NotImplementedError):
    """A checkpoint treedec's models do not run: an architecture outside the supported families, a feature of one
    not implemented (an activation, a RoPE type), quantized weights. A documented limit (the README's model table
    and limits), not a malformed file: the message names the field or tensors and what treedec runs instead. A
    ValueError (bad input: the CLI says it in one line) and a NotImplementedError (a path not built)."""
