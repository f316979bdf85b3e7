import pytest

from kvswarm import corpus

pytestmark = pytest.mark.model


def test_exact_length_and_holdout_deterministic(tokenizer):
    for src in corpus.available_sources():
        d = corpus.make_document(tokenizer, 300, seed=3, source=src, holdout=20)
        assert len(d) == 300 and len(d.continuation_ids) == 20
        assert d == corpus.make_document(tokenizer, 300, seed=3, source=src, holdout=20)
        assert d.titles and all(t.startswith(src.rstrip("s")[:3]) for t in d.titles)
    a = corpus.make_document(tokenizer, 300, seed=1)
    b = corpus.make_document(tokenizer, 300, seed=2)
    assert a.prompt_ids != b.prompt_ids


def test_chat_wrapping(tokenizer):
    d = corpus.make_document(tokenizer, 256, seed=0, source="licenses", chat=True, holdout=8)
    head, tail = corpus.chat_frame(tokenizer)
    assert len(d) == 256 and d.chat
    assert list(d.prompt_ids[:len(head)]) == head and list(d.prompt_ids[-len(tail):]) == tail
    text = tokenizer.decode(d.prompt_ids)
    assert "<|im_start|>assistant" in text and corpus.DEFAULT_INSTRUCTION in text


def test_documents_cycle_sources(tokenizer):
    docs = corpus.documents(tokenizer, 128, 3, seed=5)
    assert [d.source for d in docs] == [corpus.available_sources()[i % len(corpus.available_sources())]
                                        for i in range(3)]


def test_too_long_or_unknown(tokenizer):
    with pytest.raises(ValueError):
        corpus.make_document(tokenizer, 10, chat=True)  # shorter than the chat frame
    with pytest.raises(ValueError):
        corpus.make_document(tokenizer, 100, source="nope")
    with pytest.raises(ValueError, match="only"):
        corpus.make_document(tokenizer, 5_000_000, source="licenses")


def test_man_to_text():
    src = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.IP "\\(bu" 2m\nitem\n.sp\n'
    assert corpus.man_to_text(src) == "NAME\nls - list directory contents\n*\nitem"
