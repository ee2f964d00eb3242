"""The runtime: what runs programs. Lanes, the batch-level per-token data path (:mod:`treedec.runtime.lanes`).
(The program protocol, the scheduler loop, the online scheduler and the prefix cache join this package when
``treedec/search/`` is split into runtime/, sampling/ and programs/.)"""
from treedec.runtime.decode import Decode, DecodeResult, LaneOutput, PlacedLanes
from treedec.runtime.lanes import Lanes

__all__ = ["Decode", "DecodeResult", "LaneOutput", "Lanes", "PlacedLanes"]
