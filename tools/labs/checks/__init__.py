"""Checkers for the course labs: tools/labs/checks/dayN.py holds exercise_k(...)
for day N (the format: tools/labs/FORMAT.md)."""
