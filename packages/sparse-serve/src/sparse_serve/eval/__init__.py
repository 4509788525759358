"""Evaluation helpers: synthetic long-context tasks shared by training and the quality harness."""

from sparse_serve.eval.tasks import TASKS, Haystack, TaskSample, make_sample, token_counter

__all__ = ["TASKS", "Haystack", "TaskSample", "make_sample", "token_counter"]
