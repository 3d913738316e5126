"""Regression runs: papermill executes notebooks headless, and what they recorded is compared to
baselines.

The package by concern: suite.py (suites as data: the YAML format is documented there), rules.py
(comparison rules), execution.py (papermill), output_cap.py (the output a case may keep),
case_processes.py (ending what a notebook left running), baselines.py (per device class),
judging.py (verdicts), runner.py (`workbench regress`), out_lock.py (one run per --out), report.py
and case_report.py (HTML, Markdown, JUnit).
Nothing is imported here, so `workbench.regress.recording` can use the rules without importing the
runner.
"""
