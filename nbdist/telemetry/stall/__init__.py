"""The hang doctor's notebook half: :mod:`.thresholds` (a leaf the workers use too),
:mod:`.report` (where every rank is: a :class:`~.report.StallReport`), :mod:`.words`.

Imports nothing, so a worker importing :mod:`.thresholds` pulls in nothing else.
"""
