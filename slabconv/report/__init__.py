"""Stage 5, report: what a command did, as one typed ``Report`` (``data``) rendered for people (``render``), as
JSON (``report.json``, ``--json``; ``docs/report.md``) and as JUnit XML for CI (``junit``)."""
