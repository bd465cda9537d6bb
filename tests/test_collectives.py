"""Parsing XLA's collectives: replica groups in every form XLA prints, mapped back to mesh axes."""
import pytest

from cfp.xla.hlo import parse_collectives

_LINE = ("  %all-reduce.2 = f32[2,4,1,64]{{3,2,1,0}} all-reduce(%fusion.9), channel_id=18, {groups}, "
         "use_global_device_ids=true, to_apply=%region_4, metadata={{op_name=\"jit(f)/cfp_b4/reduce_sum\"}}")


@pytest.mark.parametrize("groups,axes", [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", (0,)),
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", (1,)),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", (0,)),
    ("replica_groups=[2,4]<=[8]", (1,)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", (0,)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", (1,)),
    # the device order of a sharding with a transposed tile assignment (XLA 0.10 prints it this way)
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=1,'axis_4'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_4'}", (0,)),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=(0,4,1,5,2,6,3,7) {'b'}", (0,)),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=(0,4,1,5,2,6,3,7) {'a'}", (1,)),
])
def test_replica_groups_map_to_mesh_axes(groups, axes):
    (c,) = parse_collectives(_LINE.format(groups=groups), (2, 4))
    assert c.kind == "all-reduce" and c.axes == axes and c.bytes == 2 * 4 * 64 * 4 and c.block == 4
