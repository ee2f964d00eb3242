"""Recorded decoding-tree workloads: the shipped DeFT data (``workloads/deft/``) and replay schedules."""
from treedec.workloads.builders import (MEDUSA_SIZES, TOT_FILES, WORKLOADS, fewshot_schedule, medusa_schedule,
                                        tot_schedule, workload_schedule)
from treedec.workloads.deft import (DEFT_DIR, MedusaTree, TotSnapshot, TraceFormatError, load_tot_trees,
                                    medusa_tree, tot_snapshot)
from treedec.workloads.schedule import (Accept, Branch, Children, Extend, Prompt, Prune, Schedule, ScheduleError,
                                        ScheduleStats, TokenTree, Truncate, load_schedule)

__all__ = ["DEFT_DIR", "MEDUSA_SIZES", "TOT_FILES", "WORKLOADS", "Accept", "Branch", "Children", "Extend",
           "MedusaTree", "Prompt", "Prune", "Schedule", "ScheduleError", "ScheduleStats", "TokenTree", "TotSnapshot",
           "TraceFormatError", "Truncate", "fewshot_schedule", "load_schedule", "load_tot_trees", "medusa_tree",
           "medusa_schedule", "tot_schedule", "tot_snapshot", "workload_schedule"]
