"""bench/kept_turns_ab.py draws one step of episodes both ways from the same prompts: the same
tokens, fewer of them prefilled with the turns' cache kept."""

import yaml

import bench.kept_turns_ab


def test_both_ways_draw_the_same_episodes_and_only_kept_turns_prefill_less(tmp_path, capsys):
    config = tmp_path / "tools.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny", "task": "guess_number",
        "max_turns": 3, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12,
        "stop": ["e"], "steps": 1, "out": str(tmp_path / "run")}))
    assert bench.kept_turns_ab.main(["--config", str(config), "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kept, whole = (int(line.split("prefill ")[1].split(" tokens")[0].replace(",", ""))
                   for line in lines[:2])
    assert lines[0].lstrip().startswith("kept") and lines[1].lstrip().startswith("whole")
    assert 0 < kept < whole
    assert lines[2] == "episodes alike both ways: 4 of 4"  # the tiny model: the same tokens
    assert lines[3].startswith("generation, kept / whole: ")
