"""A run's figures: the panels drawn are the numbers the run logged."""

import json

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


@pytest.mark.parametrize("ended, said", [("signal", True), ("error", True), ("budget", False)])
def test_the_report_of_a_run_stopped_before_its_end_says_so_first(
    tmp_path, monkeypatch, ended, said
):
    # before, a stopped run's report led with its target line alone, as a finished one's
    monkeypatch.setattr(run, "plot_run", lambda *args: None)
    why = "stopped by SIGTERM at step 850; resume with --resume out"
    summary = {"task": "digits", "ended": ended, "why": why, "target_note": "target not reached"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.toml").write_text("")
    lines = run.render(tmp_path).read_text().splitlines()
    assert (lines[2] == f"**Not ended: {why}.**") == said


@pytest.mark.parametrize("count, more", [(40, []), (45, ["- ... and 5 more (metrics.jsonl)"])])
def test_the_report_lists_forty_batch_changes_and_counts_the_rest(count, more):
    rows = [
        {"step": i, "batch_size": 16 * 2 ** (i % 2), "next_batch_size": 16 * 2 ** ((i + 1) % 2)}
        for i in range(count)
    ]
    lines = run._batch_changes(rows)
    assert lines[2] == f"{count} changes of the batch size:"
    assert sum(line.startswith("- batch") for line in lines) == 40
    assert [line for line in lines if " more " in line] == more
