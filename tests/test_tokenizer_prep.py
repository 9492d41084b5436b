"""The served tokenizer's lazily built tables, prepared in the background after start-up
(:mod:`redlite.server.tokenizer_prep`)."""

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.grammar import _ATTR, grammar_tokenizer
from redlite.server.tokenizer_prep import prepare_tokenizer, start_tokenizer_prep


def test_prepare_builds_the_grammar_vocabulary_once():
    tok = ByteTokenizer()
    assert getattr(tok, _ATTR, None) is None
    built = prepare_tokenizer(tok)
    assert "grammar vocabulary" in built and "chat template" in built
    cached = getattr(tok, _ATTR)
    assert grammar_tokenizer(tok) is cached  # a request now finds it built


def test_a_failing_tokenizer_is_logged_not_raised(caplog):
    class Broken(ByteTokenizer):
        def render_chat(self, messages, **kwargs):
            raise RuntimeError("template broken")
    start_tokenizer_prep(Broken()).join(10)
    assert "tokenizer tables not prepared" in caplog.text


def test_the_server_prepares_its_tokenizer_after_listening():
    from server_process import ServerProcess
    with ServerProcess() as server:
        log = server.wait_for_log("tokenizer tables ready", timeout_s=30)
    assert log.index("listening on") < log.index("tokenizer tables ready")
    assert "grammar vocabulary" in log
