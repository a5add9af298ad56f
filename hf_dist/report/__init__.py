"""Run reports: the JSON-lines log a DistTrainer run writes, and the PNG ``hf-dist report`` draws from it."""

from hf_dist.report.log_history import LOG_FILE, LogHistoryCallback, read_log_history
from hf_dist.report.plot import draw_report

__all__ = ["LOG_FILE", "LogHistoryCallback", "draw_report", "read_log_history"]
