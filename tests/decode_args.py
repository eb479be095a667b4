"""Abstract arguments of the rollout engine's decode program (delta_jax.sampling.programs.decode)
for tests that lower, compile or measure it."""
import jax
import jax.numpy as jnp
import numpy as np


def abstract_decode_args(graphdef, state, cache, num_slots: int, pages_per_seq: int, *,
                         queued: int = 0, row_sharding=None) -> tuple:
    """decode's positional arguments for `num_slots` slots and `queued` staged entries (default:
    as many as slots), temperature 1, no top-p, four stop ids; its static arguments are the
    caller's."""
    from delta_jax.sampling import programs

    def rows(n):
        def of(*shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding)
        return programs.Rows(of(n, pages_per_seq), of(n), of(n), of(n), of(n, dtype=jnp.bool_),
                             of(n), of(n), of(n))

    layers = jax.eval_shape(programs.decode_layers, graphdef, state)
    return (graphdef, state, layers, cache, rows(num_slots), rows(queued or num_slots),
            np.uint32(0), jnp.zeros(4, jnp.int32), np.float32(1.0), np.float32(1.0), np.int32(0),
            np.int32(1))


def abstract_write_attend_args(mesh, *, B=8, K=8, G=2, D=128, page_size=32, pages=64,
                               pages_per_seq=8, dtype=jnp.bfloat16) -> tuple:
    """models.attention.paged_write_attend's positional arguments (qkv [B, K, G + 2, D], the two
    pools, write_page, write_offset, block_tables, lengths) from abstract shapes, the rows split
    over the mesh's "data" axis and the pools laid out as attention.pool_specs lays them."""
    from jax.sharding import NamedSharding, PartitionSpec
    from delta_jax.models import attention
    rows = NamedSharding(mesh, PartitionSpec("data"))
    pool = NamedSharding(mesh, attention.pool_specs(mesh, ("data",), K)[0])
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    return (sd((B, K, G + 2, D), dtype, sharding=rows),
            sd((K, pages, page_size, D), dtype, sharding=pool),
            sd((K, pages, page_size, D), dtype, sharding=pool), sd((B,), i32, sharding=rows),
            sd((B,), i32, sharding=rows), sd((B, pages_per_seq), i32, sharding=rows),
            sd((B,), i32, sharding=rows))
