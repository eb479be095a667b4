"""Abstract arguments of the paged write-and-attend step (models.attention.paged_write_attend)
for tests that lower or compile it. (The decode program's: programs.abstract_decode_args.)"""
import jax
import jax.numpy as jnp


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
