"""The model's cuDNN attention paths on a machine without cuDNN, for tests: jax's own XLA kernel
runs every jax.nn.dot_product_attention call that asks for cuDNN (with the same arguments: key
lengths, causal mask), and with `resolve` attention dispatch resolves to cuDNN as on a CUDA GPU
while the permuting path (attend_packed_causal) is refused."""
import jax

from delta_jax.models import attention


def xla_for_cudnn(patch) -> None:
    """`patch` (a pytest MonkeyPatch or its context) makes jax.nn.dot_product_attention run
    jax's XLA implementation whatever implementation is asked for."""
    run = jax.nn.dot_product_attention

    def xla(*args, implementation=None, **kwargs):
        return run(*args, implementation="xla", **kwargs)
    patch.setattr(jax.nn, "dot_product_attention", xla)


def as_on_a_cuda_gpu(patch) -> None:
    """The model's attention as a CUDA GPU resolves it (cuDNN), cuDNN's calls run by the XLA
    kernel (xla_for_cudnn), and the permuting path refused: the model's passes and the prefill
    never take it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the attention permuted its rows (attend_packed_causal)")
    xla_for_cudnn(patch)
    patch.setattr(attention, "cudnn_supported", lambda *args, **kwargs: True)
    patch.setattr(attention, "attend_packed_causal", refuse)
