"""The layout planner: memory and step-time models of a job's layouts, and their ranking.

Pure functions of the job and a machine profile: no process, no device. `optimus plan` and
`optimus config check` call the same models.
"""

from optimus.planner.memory import Memory, PlanLayout, peak_memory, rank_memory

__all__ = ["Memory", "PlanLayout", "peak_memory", "rank_memory"]
