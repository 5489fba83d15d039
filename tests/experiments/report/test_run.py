"""A run's figures: the panels drawn are the numbers the run logged."""

import pytest

from bigbatch.experiments.report import run


def _rows(similarity: bool) -> list[dict]:
    rows = [
        {"step": i, "samples": 8 * i, "batch_size": 8, "lr": 0.01, "loss": 1 / i} for i in (1, 2, 3)
    ]
    for r in rows if similarity else ():
        r["similarity"] = 0.5
    return rows


@pytest.mark.parametrize("similarity, panels", [(True, 2), (False, 1)])
def test_the_batch_figure_has_a_similarity_panel_only_where_one_was_measured(
    tmp_path, monkeypatch, similarity, panels
):
    drawn = {}

    def count_panels(fig, path):
        drawn[path.name] = len(fig.axes)
        run.plt.close(fig)

    monkeypatch.setattr(run, "save", count_panels)
    run.plot_run(_rows(similarity), tmp_path, "a run")
    assert drawn["batch_similarity.png"] == panels
