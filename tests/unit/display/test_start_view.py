"""How a start looks while its workers come up (:mod:`nbdist.display.start_view`): one line,
updated in place, drawn only where a kernel can update it."""

from __future__ import annotations

from nbdist.display.start_view import StartProgress, start_progress


def test_a_start_says_how_many_workers_are_ready():
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle["text/plain"])

    def display(bundle, raw, display_id):
        shown.append(bundle["text/plain"])
        return Handle()

    clock = iter([0.0, 1.0, 9.0, 27.0])
    view = StartProgress(display, clock=lambda: next(clock))
    view(0, 17)
    view(5, 17)
    view(17, 17)
    assert shown == ["nbdist: starting 17 workers: 0 of 17 ready (1 s)",
                     "nbdist: starting 17 workers: 5 of 17 ready (9 s)",
                     "nbdist: 17 of 17 workers ready in 27 s"]


def test_one_display_is_made_and_then_updated_with_the_html_beside_the_text():
    made, updated = [], []

    class Handle:
        def update(self, bundle, raw):
            updated.append(bundle)

    def display(bundle, raw, display_id):
        made.append((raw, display_id))
        return Handle()

    view = StartProgress(display, clock=lambda: 0.0)
    for ready in range(4):
        view(ready, 3)
    assert made == [(True, True)] and len(updated) == 3
    assert view.text in updated[-1]["text/html"] and "class='nbdist-start'" in updated[-1][
        "text/html"]


def test_without_a_kernel_nothing_is_drawn():
    assert start_progress(kernel=False) is None
