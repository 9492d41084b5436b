"""The weight fingerprint tells apart models that differ in a single weight element."""

import torch

from redlite.engine.fingerprint import device_digest, tensor_digest, weights_fingerprint
from redlite.engine.torch_engine import TorchEngine
from redlite.models.llama import LlamaModel

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=160,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False)


def model(seed=0):
    m = LlamaModel(dict(CONFIG), device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return m.eval()


def old_sample_indices(numel):
    """The elements the previous fingerprint hashed: 256 spread evenly over the tensor."""
    step = max(1, numel // 256)
    return set(range(0, numel, step)[:256])


def test_models_differing_in_one_element_outside_the_old_sample_differ():
    base, tuned = model(), model()
    assert TorchEngine(base, ctx_size=16).fingerprint() == TorchEngine(tuned, ctx_size=16).fingerprint()
    name, weight = max(tuned.state_dict().items(), key=lambda item: item[1].numel())
    flat = weight.view(-1)
    index = next(i for i in range(1, flat.numel()) if i not in old_sample_indices(flat.numel()))
    with torch.no_grad():
        flat[index] = torch.nextafter(flat[index], torch.tensor(1.0))  # one ulp
    assert TorchEngine(base, ctx_size=16).fingerprint() != TorchEngine(tuned, ctx_size=16).fingerprint()


def test_device_digest_detects_any_one_changed_word_and_swaps():
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4 * 1000 + 3,), dtype=torch.uint8, generator=gen)
    reference = device_digest(raw)
    assert device_digest(raw.clone()) == reference
    for index in (0, 1, 2001, 3999, 4001, 4002):  # words and the tail
        for delta in (1, 128):
            changed = raw.clone()
            changed[index] = (int(changed[index]) + delta) % 256
            assert device_digest(changed) != reference, (index, delta)
    words = raw[:4000].view(torch.int32).clone()
    words[[5, 9]] = words[[9, 5]]  # two elements swapped
    swapped = torch.cat([words.view(torch.uint8), raw[4000:]])
    assert torch.equal(swapped, raw) or device_digest(swapped) != reference


def test_device_digest_chunking_matches_one_pass(monkeypatch):
    from redlite.engine import fingerprint
    raw = torch.randint(0, 256, (4 * 5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    whole = device_digest(raw)
    monkeypatch.setattr(fingerprint, "CHUNK_WORDS", 777)
    assert device_digest(raw) == whole


def test_fingerprint_covers_names_shapes_dtype_and_config():
    t = torch.arange(12, dtype=torch.float32)
    base = weights_fingerprint({"a": 1}, torch.float32, [("w", t)])
    assert base == weights_fingerprint({"a": 1}, torch.float32, [("w", t.clone())])
    assert base != weights_fingerprint({"a": 2}, torch.float32, [("w", t)])
    assert base != weights_fingerprint({"a": 1}, torch.bfloat16, [("w", t)])
    assert base != weights_fingerprint({"a": 1}, torch.float32, [("v", t)])
    assert base != weights_fingerprint({"a": 1}, torch.float32, [("w", t.view(3, 4))])
    assert tensor_digest(t[::2]) == tensor_digest(t[::2].contiguous())  # strided views: by value
