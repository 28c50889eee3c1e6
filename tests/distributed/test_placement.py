"""Which GPU each actor reserves (worker_gpus > 0): the plan of placement-group bundles, at
most one trainer worker per GPU, and layouts that cannot be placed refused naming the
options; then the plan on a real local Ray instance with two (fake) GPUs, and a GPU actor
whose torch sees no CUDA refused with one line instead of running on the CPU."""

import pytest
import torch

from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.train.distributed.placement import plan_placement


@pytest.mark.parametrize("rollout, train, gpus, cluster, bundles, rollout_at", [
    (1, 1, 0.5, 1, [2], [0]),  # a trainer and a rollout actor share one GPU
    (2, 2, 0.5, 2, [2, 2], [0, 1]),
    (3, 1, 0.5, 4, [2, 2], [1, 0, 1]),  # rollouts to the emptiest GPU
    (1, 2, 0.25, 2, [2, 1], [0]),  # one GPU per trainer even when fewer would hold them
    (4, 1, 0.3, 2, [3, 2], [1, 0, 1, 0]),  # 3 actors fit 0.3 GPU each (0.9)
    (2, 2, 1, 4, [1, 1, 1, 1], [2, 3]),
])
def test_each_trainer_gets_a_gpu_of_its_own_and_the_rollouts_fill_them_evenly(
        rollout, train, gpus, cluster, bundles, rollout_at):
    plan = plan_placement(rollout, train, 0.5, gpus, cluster)
    assert plan.train == list(range(train))
    assert plan.rollout == rollout_at
    assert plan.bundles == [{"CPU": 0.5 * n, "GPU": 1.0} for n in bundles]
    members = [plan.train.count(b) + plan.rollout.count(b) for b in range(len(plan.bundles))]
    assert members == bundles


def test_actors_of_several_gpus_get_whole_bundles_and_cpu_actors_no_plan():
    plan = plan_placement(1, 2, 4.0, 2, 8)
    assert plan.bundles == [{"CPU": 4.0, "GPU": 2.0}] * 3
    assert (plan.train, plan.rollout) == ([0, 1], [2])
    assert plan_placement(2, 2, 1.0, 0, 0) is None


@pytest.mark.parametrize("rollout, train, gpus, cluster, message", [
    (2, 2, 0.5, 1, r"^worker_gpus=0.5: rollout_workers=2 and train_workers=2 need 2 GPUs "
                   r"\(each GPU holds at most 2 actors and one trainer worker, since NCCL "
                   r"cannot put two ranks of the trainers' group on one GPU\), and the Ray "
                   r"cluster has 1; lower rollout_workers or train_workers, or change "
                   r"worker_gpus$"),
    (1, 1, 1, 1, r"^worker_gpus=1: rollout_workers=1 and train_workers=1 need 2 GPUs \(1 GPU "
                 r"of its own for each actor\), and the Ray cluster has 1"),
    (3, 1, 0.5, 1, r"need 2 GPUs .* has 1"),
    (1, 1, 1.5, 8, r"^worker_gpus=1.5: above 1 an actor's GPUs must be a whole number"),
])
def test_a_layout_that_cannot_be_placed_is_refused_naming_the_options(rollout, train, gpus,
                                                                      cluster, message):
    with pytest.raises(ConfigError, match=message):
        plan_placement(rollout, train, 1.0, gpus, cluster)


# --- on a real local Ray instance with 2 GPUs that exist only in Ray's bookkeeping ---------


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    ray = pytest.importorskip("ray")
    import postrl

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"py_modules": [postrl]})
    yield ray
    ray.shutdown()


class Probe:
    """An actor that only says which GPUs Ray gave it (TrainWorker would need CUDA)."""

    def gpus(self) -> list:
        import ray

        return [str(gpu) for gpu in ray.get_gpu_ids()]


def test_the_plan_puts_no_two_trainers_on_one_gpu_on_a_real_ray(ray_with_two_gpus):
    """2 rollout actors and 2 trainers at worker_gpus=0.5 on 2 GPUs, placed as planned:
    each trainer on a GPU of its own, each rollout actor beside one of them."""
    ray = ray_with_two_gpus
    from postrl.train.distributed.cluster import actor_resources, place, stop

    cfg = TrainConfig(launcher="ray", rollout_workers=2, train_workers=2, worker_cpus=0.25,
                      worker_gpus=0.5)
    cpus, plan = actor_resources(cfg, 4)
    group, rollout_options, train_options = place(plan, cpus, cfg.worker_gpus, 2, 2)
    probe = ray.remote(Probe)
    rollout = [probe.options(**options).remote() for options in rollout_options]
    train = [probe.options(**options).remote() for options in train_options]
    try:
        rollout_gpus = ray.get([actor.gpus.remote() for actor in rollout], timeout=120)
        train_gpus = ray.get([actor.gpus.remote() for actor in train], timeout=120)
        assert all(len(gpus) == 1 for gpus in rollout_gpus + train_gpus)
        assert train_gpus[0] != train_gpus[1]
        for index, bundle in enumerate(plan.rollout):
            assert rollout_gpus[index] == train_gpus[plan.train.index(bundle)]
    finally:
        stop(rollout + train, group, owns_ray=False)
    assert ray.util.placement_group_table()[group.id.hex()]["state"] == "REMOVED"


def test_more_trainers_than_gpus_are_refused_before_any_actor_starts(ray_with_two_gpus):
    from postrl.train.distributed.cluster import actor_resources

    cfg = TrainConfig(launcher="ray", rollout_workers=1, train_workers=3, worker_cpus=0.25,
                      worker_gpus=0.25)
    with pytest.raises(ConfigError, match=r"^worker_gpus=0.25: rollout_workers=1 and "
                                          r"train_workers=3 need 3 GPUs .* cluster has 2"):
        actor_resources(cfg, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="here torch sees a GPU")
def test_a_gpu_train_worker_whose_torch_sees_no_cuda_is_refused_with_one_line(
        ray_with_two_gpus):
    """Ray reserves a (fake) GPU for the actor, its torch sees none: the driver gets the
    worker's ConfigError, not a dead-actor report, and no run falls back to the CPU."""
    ray = ray_with_two_gpus
    from postrl.train.distributed.failures import gather
    from postrl.train.distributed.training import TrainWorker

    cfg = TrainConfig(model="tiny", launcher="ray", worker_gpus=0.5)
    actor = ray.remote(TrainWorker).options(num_cpus=0.25, num_gpus=0.5).remote(cfg, 0, 1, 1)
    try:
        with pytest.raises(ConfigError, match=r"^worker_gpus=0.5: train worker 1/1 reserved a "
                                              r"GPU, but torch in that actor sees no CUDA GPU "
                                              r"\(.*\); check .* or set worker_gpus=0$"):
            gather([actor.pid.remote()], ["train worker 1/1"], "hint")
    finally:
        ray.kill(actor)
