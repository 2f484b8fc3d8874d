"""The lab machinery: solved notebooks in `solutions/` generate the learners'
notebooks in `labs/`, and checker modules test a learner's code against the
reference engine. The notebook format (cell tags, solution markers) is
documented once, in tools/labs/FORMAT.md."""
