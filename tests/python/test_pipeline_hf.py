"""gpipe.pipeline with its defaults on Hugging Face causal LMs (Llama, Qwen2, Mixtral, GPT-2; tiny
random configs, tied embeddings, float64): tracer="auto" falls back to torch.export where torch.fx
cannot trace the mask code, stages=K splits inside model.layers, and outputs, every grad,
train_step and the tie equal the plain model's. Over ranks: test_distributed_pipeline.py."""
from typing import Any, Dict

import pytest
import torch
from torch import Tensor, nn

import gpipe
from conftest import TOL, lm_loss, max_diff, padding_mask, token_ids
from test_pipeline import grads_equal, outputs_and_grads_equal, train_step_equals_plain, twin

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

V, T = 64, 6


def causal_lm(family: str, layers: int = 4, use_cache: bool = False) -> nn.Module:
    """A tiny random causal LM of ``family``, tied head, float64, eval mode; ``use_cache``
    as its config says (True is transformers' default)."""
    common: Dict[str, Any] = dict(vocab_size=V, tie_word_embeddings=True, use_cache=use_cache,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, n_positions=16,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         **common)
        return transformers.GPT2LMHeadModel(config).double().eval()
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                 **common)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    else:
        # The default experts kernel (grouped_mm) takes no float64 on the CPU, and the eager
        # one loops over the experts hit (data-dependent: neither tracer follows it).
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm",
            **sizes))
    return model.double().eval()


def ids(rows: int) -> Tensor:
    return token_ids(rows, V, T)


def padding(rows: int) -> Tensor:
    return padding_mask(rows, T)


def embedding(model: nn.Module) -> nn.Parameter:
    return model.get_input_embeddings().weight


FAMILIES = ["llama", "qwen2", "mixtral", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_and_automatic_splits_equal_the_model(family: str) -> None:
    # Issue 45: no tracer and no split points named; stages=4 splits inside model.layers.
    model = causal_lm(family)
    plain = twin(model)
    pipe = gpipe.pipeline(model, example_args=(ids(2),), stages=4, chunks=3,
                          checkpoint="except_last")
    assert pipe.tracer == "export"  # torch.fx cannot trace transformers' mask code
    layers = "transformer.h." if family == "gpt2" else "model.layers."
    assert len(pipe) == 4 and len(pipe.split_points) == 3, pipe.split_points
    assert all(sp.startswith(layers) for sp in pipe.split_points), pipe.split_points
    # The tie is one parameter, its grad the sum of the embedding's and the head's.
    assert model.lm_head.weight is embedding(model)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    assert list(pipe.state_dict()) == list(model.state_dict())
    x = ids(5)  # uneven micro-batches
    out, ref = pipe(x), plain(x)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
    outputs_and_grads_equal(out.logits, ref.logits, model, plain)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_named_split_points_with_a_mask_and_train_step(family: str) -> None:
    # Issue 45 item 1: split points named by hand, the default tracer, a padding mask.
    model = causal_lm(family)
    plain = twin(model)
    layers = "transformer.h" if family == "gpt2" else "model.layers"
    pipe = gpipe.pipeline(model, [f"{layers}.1", f"{layers}.3"], (ids(2),),
                          {"attention_mask": padding(2)}, chunks=3, schedule="1f1b")
    assert pipe.split_points == [f"{layers}.1", f"{layers}.3"] and pipe.tracer == "export"
    mask = padding(7)
    train_step_equals_plain(pipe, model, plain, (ids(7),), ids(7), lm_loss,
                            kwargs={"attention_mask": mask})


def test_balanced_by_time_inside_the_layers() -> None:
    model = causal_lm("llama", layers=3)
    plain = twin(model)
    pipe = gpipe.pipeline(model, example_args=(ids(2),), stages=2, balance_by="time")
    assert len(pipe.split_points) == 1 and pipe.split_points[0].startswith("model."), \
        pipe.split_points
    assert all(p.grad is None for p in model.parameters())  # profiling left no grads
    x = ids(3)
    assert max_diff(pipe(x).logits, plain(x).logits) < TOL


def test_the_config_s_default_use_cache_is_passed_as_false() -> None:
    # transformers' configs default to use_cache=True, and the forward then returns a
    # DynamicCache, which no Pipe can cut or join: the pipe passes use_cache=False.
    model = causal_lm("llama", layers=2, use_cache=True)
    plain = twin(model)
    pipe = gpipe.pipeline(model, example_args=(ids(2),), stages=2, chunks=2)
    assert pipe.input_names == ["input_ids"]
    x = ids(5)
    out, ref = pipe(x), plain(x)
    assert ref.past_key_values is not None and list(out.keys()) == ["logits"]
    outputs_and_grads_equal(out.logits, ref.logits, model, plain)
    assert max_diff(pipe(x, use_cache=False).logits, ref.logits) < TOL
    with pytest.raises(TypeError, match="use_cache=False .gpipe.pipeline passes it"):
        pipe(x, use_cache=True)


def test_a_non_tensor_argument_is_fixed_under_export() -> None:
    # use_cache=False given as an argument (not in the config): fixed, as fx fixes one.
    model = causal_lm("qwen2", layers=2, use_cache=True)
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["model.layers.1"], (ids(2),), {"use_cache": False}, chunks=2)
    assert pipe.tracer == "export" and pipe.input_names == ["input_ids"]
    x = ids(4)
    out, ref = pipe(x, use_cache=False), plain(x, use_cache=False)
    outputs_and_grads_equal(out.logits, ref.logits, model, plain)
    with pytest.raises(TypeError, match="use_cache=False"):
        pipe(x, use_cache=True)
    grads_equal(model, plain)


def test_a_split_at_the_head_traces_with_fx() -> None:
    # Only the root is traced (model is one call): fx suffices, and the ModelOutput's fields
    # the model leaves unset (None on the example) come back as None, not as outputs.
    model = causal_lm("llama", layers=2)
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["lm_head"], (ids(2),), chunks=2)
    assert pipe.tracer == "fx" and pipe.split_points == ["lm_head"]
    x = ids(5)
    out, ref = pipe(x), plain(x)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys()) == ["logits"]
    outputs_and_grads_equal(out.logits, ref.logits, model, plain)


def other_causal_lm(family: str) -> nn.Module:
    """More families, tiny and tied, through the same defaults (built from configs)."""
    common: Dict[str, Any] = dict(vocab_size=V, tie_word_embeddings=True, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    llama_like = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    configs = {
        "mistral": ("MistralConfig", "MistralForCausalLM", llama_like),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(llama_like, head_dim=4)),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", llama_like),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(llama_like, head_dim=4)),
        "opt": ("OPTConfig", "OPTForCausalLM",
                dict(hidden_size=16, ffn_dim=32, num_hidden_layers=3, num_attention_heads=4,
                     max_position_embeddings=32, word_embed_proj_dim=16)),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                     dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=32)),
        "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=16, n_layer=3, n_head=4)),
    }
    config, model, sizes = configs[family]
    built = getattr(transformers, model)(getattr(transformers, config)(**common, **sizes))
    return built.double().eval()


@pytest.mark.parametrize("family", ["mistral", "qwen3", "phi3", "gemma", "opt", "gpt_neox",
                                    "bloom"])
def test_more_families_with_the_defaults(family: str) -> None:
    model = other_causal_lm(family)
    plain = twin(model)
    # Gemma's RMSNorm computes in float32 whatever the model's dtype, so its weights' grads,
    # summed over micro-batches, match to float32's precision only: one micro-batch there.
    chunks = 1 if family == "gemma" else 2
    pipe = gpipe.pipeline(model, example_args=(ids(2),), stages=3, chunks=chunks)
    assert pipe.tracer == "export" and len(pipe.split_points) == 2
    assert all(".layers." in sp or ".h." in sp for sp in pipe.split_points), pipe.split_points
    x = ids(4)
    outputs_and_grads_equal(pipe(x).logits, plain(x).logits, model, plain)
