import numpy as np
import pytest
import torch

from kvswarm.sparse import ActivationTrace, Selection, StepQuery, TraceRecorder, load_trace, make_selector


def _q(step, layer):
    return StepQuery(layer, step, torch.zeros(9, 8), torch.zeros(3, 2, 8), 1.0)


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    rec = TraceRecorder(layers=3, meta={"model_id": "m", "prompt_tokens": 100})
    want = {}
    for step in range(4):
        for layer in (2, 0, 1):  # arrival order within a step does not matter
            ids = np.sort(rng.choice(100, size=rng.integers(0, 12), replace=False))
            want[step, layer] = ids
            rec.on_select(_q(step, layer), Selection(ids, rng.random(len(ids)).astype(np.float32)))
    path = tmp_path / "t.npz"
    rec.save(path)
    t = load_trace(path)
    assert (t.steps, t.layers, t.meta["model_id"]) == (4, 3, "m")
    for (step, layer), ids in want.items():
        assert np.array_equal(t.selected(step, layer), ids)
        assert t.selected_scores(step, layer).dtype == np.float16
    assert [(s, lay) for s, lay, _ in t] == [(s, lay) for s in range(4) for lay in range(3)]
    inc = t.incidence(1)
    assert inc.shape == (4, 100) and inc[2].nnz == len(want[2, 1])
    assert t.mass is None
    with np.load(path, allow_pickle=False) as z:  # plain arrays only, no pickle
        assert set(z.files) == {"format", "meta", "shape", "offsets", "ids", "scores"}


def test_oracle_recorder_records_exact_topk():
    keys = torch.randn(3, 50, 8)
    oracle = make_selector("oracle")
    oracle.build(0, keys, np.arange(10, 60))
    rec = TraceRecorder(layers=1, oracle=oracle, budget=5)
    q = StepQuery(0, 0, torch.randn(9, 8), torch.randn(3, 4, 8), 0.3)
    rec.on_select(q, Selection(np.arange(10, 60)))
    t = rec.trace()
    assert np.array_equal(t.selected(0, 0), oracle.select(q, 5).positions)
    assert 0 < t.mass[0] < 1


def test_bad_traces(tmp_path):
    rec = TraceRecorder(layers=2)
    rec.on_select(_q(0, 0), Selection(np.arange(3)))
    with pytest.raises(ValueError):
        rec.trace()  # half a step
    rec.on_select(_q(0, 0), Selection(np.arange(3)))
    with pytest.raises(ValueError):
        rec.trace()  # layer 0 twice, layer 1 never
    t = ActivationTrace({}, 1, 1, np.array([0, 2]), np.array([1, 2], np.int32))
    t.save(tmp_path / "ok.npz")
    with pytest.raises(IndexError):
        load_trace(tmp_path / "ok.npz").selected(1, 0)
    np.savez(tmp_path / "v9.npz", format=np.array([9]), shape=np.array([1, 1]), offsets=np.array([0, 0]),
             ids=np.zeros(0, np.int32), meta=np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="format 9"):
        load_trace(tmp_path / "v9.npz")


@pytest.mark.model
def test_record_trace_from_the_real_model(lm, tmp_path):
    from kvswarm import corpus
    from kvswarm.traces import record_trace

    doc = corpus.make_document(lm.tokenizer, 128, seed=1, source="licenses", chat=True)
    t = record_trace(lm, doc, 3, sparsity=0.1, window=16)
    t.save(tmp_path / "real.npz")
    t = load_trace(tmp_path / "real.npz")
    assert (t.steps, t.layers) == (3, lm.layout.num_layers)
    budget = t.meta["budget"]
    assert budget == 11 and t.meta["off_start"] == 4 and t.meta["off_end"] == 112
    for _, _, ids in t:
        assert len(ids) == budget and ids.min() >= 4 and ids.max() < 112
    assert np.all((t.mass > 0) & (t.mass < 1)) and len(t.meta["generated_ids"]) == 3


@pytest.mark.model
def test_trace_of_a_users_text_file(lm, tmp_path):
    from kvswarm.cli import build_parser
    from kvswarm.corpus import file_source
    from kvswarm.traces import record_traces

    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(f"Note {i}: drives fail, caches warm, entry {i} stays." for i in range(60)),
                    encoding="utf-8")
    args = build_parser().parse_args(["trace", str(tmp_path / "out"), "--text-file", str(text)])
    assert args.text_file == [str(text)]
    (path,) = record_traces(tmp_path / "out", tokens=96, steps=2, count=1, sources=[file_source(text)], window=16,
                            lm=lm)
    assert path.name == "trace-notes-96t-2s-seed0.npz"
    t = load_trace(path)
    assert t.steps == 2 and t.meta["source"] == "file:" + str(text.resolve())
