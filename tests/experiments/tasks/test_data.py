"""The tasks' data: MNIST-1D and the digits (cached), the Markov language, the text corpus
and its windows."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bigbatch.experiments import tasks


def test_mnist1d_is_generated_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path))
    # 2,000 samples: the task's 50,000 take half a minute to generate on two cores
    first = tasks.mnist1d_arrays(samples=2_000)
    assert first["x"].shape == (1_600, 40) and first["x_test"].shape == (400, 40)
    assert sorted(np.unique(first["y"])) == list(range(10))
    (cached,) = tmp_path.glob("mnist1d-*.npz")
    umask = os.umask(0)
    os.umask(umask)
    assert cached.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any file written
    again = tasks.mnist1d_arrays(samples=2_000)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_the_digits_are_scikit_learns_read_from_the_cache_after_the_first_time(
    tmp_path, monkeypatch
):
    from sklearn.datasets import load_digits

    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path))
    first = tasks.digits_arrays()
    digits = load_digits()
    assert np.array_equal(first["x"], digits.data) and first["x"].dtype == digits.data.dtype
    assert np.array_equal(first["y"], digits.target)
    assert [p.name for p in tmp_path.iterdir()] == ["digits.npz"]
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # an import now fails
    again = tasks.digits_arrays()
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_two_processes_building_the_mnist1d_cache_at_once_both_get_it(tmp_path, monkeypatch):
    """Both writers finish writing before either renames (the ranks of a torchrun job on a
    fresh machine): each must rename its own file, not find the other's gone."""
    import threading

    from bigbatch.experiments.tasks import data

    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path))
    both_written = threading.Barrier(2, timeout=60)
    savez = np.savez

    def savez_then_wait(file, **arrays):
        savez(file, **arrays)
        both_written.wait()

    monkeypatch.setattr(data.np, "savez", savez_then_wait)
    # mnist1d seeds numpy's global generator: threads (unlike processes) must take turns
    import mnist1d.data

    generating = threading.Lock()
    make_dataset = mnist1d.data.make_dataset

    def one_at_a_time(args):
        with generating:
            return make_dataset(args)

    monkeypatch.setattr(mnist1d.data, "make_dataset", one_at_a_time)
    results, errors = [], []

    def build():
        try:
            results.append(tasks.mnist1d_arrays(samples=2_000))
        except Exception as err:
            errors.append(err)

    writers = [threading.Thread(target=build) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert errors == [] and len(results) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["mnist1d-2000-seed42.npz"]  # no leftovers
    assert all(np.array_equal(results[0][k], results[1][k]) for k in results[0])


def test_markov_language_entropy_is_the_loss_floor():
    transition, floor = tasks.markov_language(vocab=4, alpha=1.0, seed=0)
    rows = transition.sum(1)
    assert np.allclose(rows.numpy(), 1.0)
    assert 0 < floor < np.log(4)


def _source_tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_text_corpus_is_deterministic_and_holds_whole_files_out(tmp_path):
    files = {f"pkg/mod{i:03d}.py": f"x = {i}\n" * (i % 7 + 1) for i in range(60)}
    _source_tree(tmp_path, files)
    train, validation, info = tasks.text_corpus(tmp_path)
    again = tasks.text_corpus(tmp_path)
    assert np.array_equal(train, again[0]) and np.array_equal(validation, again[1])
    assert info == again[2]
    held = sorted(n for n in files if tasks.data.held_out(n))
    assert info["validation_files"] == len(held) and 0 < len(held) < 15  # about a tenth
    assert info["train_files"] + info["validation_files"] == 60
    # whole files, in sorted order, on the side their path hashes to
    assert validation.tobytes() == "".join(files[n] for n in held).encode()
    assert info["corpus_bytes"] == train.size + validation.size
    (tmp_path / "pkg/mod000.py").write_text("changed\n")
    assert tasks.text_corpus(tmp_path)[2]["corpus_sha256"] != info["corpus_sha256"]


def test_a_folder_named_like_a_source_file_and_a_dead_link_are_not_source(tmp_path):
    _source_tree(tmp_path, {f"mod{i:02d}.py": f"x = {i}\n" for i in range(40)})
    before = tasks.text_corpus(tmp_path)[2]
    (tmp_path / "package.py").mkdir()  # read as a file before: "Is a directory"
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")
    assert tasks.text_corpus(tmp_path)[2] == before


def test_corpus_root_is_an_installed_packages_folder_or_a_folder_given_as_a_path(
    tmp_path, monkeypatch
):
    torch_folder = Path(torch.__file__).parent
    assert tasks.data.corpus_root("torch") == torch_folder
    assert tasks.data.corpus_root("torch.nn") == torch_folder / "nn"
    assert tasks.data.corpus_root(str(tmp_path)) == tmp_path.resolve()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torch").mkdir()  # a folder here never shadows the package of that name
    assert tasks.data.corpus_root("torch") == torch_folder
    assert tasks.data.corpus_root("./torch") == (tmp_path / "torch").resolve()
    (tmp_path / "notes.py").write_text("x = 1\n")
    for bad, why in [
        ("", "is empty"),
        ("no_such_package_here", "is not an installed package"),
        ("./nowhere", "is not a folder"),
        ("./notes.py", "is not a folder"),
        ("typing", "is a single-file module"),
    ]:
        with pytest.raises(ValueError, match=why):
            tasks.data.corpus_root(bad)


def test_byte_windows_predict_every_byte_once_or_spread_evenly():
    stream = np.arange(20, dtype=np.uint8)
    every = tasks.byte_windows(stream, 5)
    assert every.dtype == torch.uint8 and every.shape == (4, 5)
    assert every[1].tolist() == [4, 5, 6, 7, 8]  # windows overlap by the one byte they predict
    spread = tasks.byte_windows(stream, 5, count=3)
    assert [w[0].item() for w in spread] == [0, 7, 15]
    with pytest.raises(ValueError, match="hold no window"):
        tasks.byte_windows(stream[:3], 5)
