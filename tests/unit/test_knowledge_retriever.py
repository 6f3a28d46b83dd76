"""The demo retriever's ranking: the README's and the quick start's first invoke asks it for
"durable retries", and every passage scored 0 ("retries" was stemmed "retrie", the corpus
says "retry"), so a newcomer's first answer looked like a search that found nothing."""

from __future__ import annotations

from examples.knowledge_retriever import rank


def test_the_first_invokes_query_finds_the_passage_about_retries() -> None:
    [best, _] = rank("durable retries", 2)
    assert best["score"] >= 1
    assert "retry" in best["text"]


def test_plurals_match_their_singulars() -> None:
    assert rank("instances", 1)[0]["score"] >= 1
    assert rank("heartbeat", 1)[0]["text"].startswith("Heartbeats")
    assert all(p["score"] == 0 for p in rank("nothing here", 6))


def test_every_option_of_the_demo_agent_says_what_it_does() -> None:
    """`--help` listed half the options bare (--capability, --defer, --ledger, ...)."""
    from examples.knowledge_retriever import parser

    bare = [
        action.option_strings[-1]
        for action in parser()._actions
        if action.option_strings and not action.help
    ]
    assert bare == []
    assert "seconds between heartbeats" in parser().format_help()
