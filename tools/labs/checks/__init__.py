"""Checkers for the course labs: tools/labs/checks/dayN.py holds exercise_k(...) for day N (see tools/labs/FORMAT.md)."""
