"""Recorded decoding-tree workloads: loaders for the shipped DeFT data (``workloads/deft/``)."""
from treedec.workloads.deft import (DEFT_DIR, MedusaTree, TotSnapshot, TraceFormatError, load_tot_trees,
                                    medusa_tree, tot_snapshot)

__all__ = ["DEFT_DIR", "MedusaTree", "TotSnapshot", "TraceFormatError", "load_tot_trees", "medusa_tree",
           "tot_snapshot"]
