"""loss.png of a preference run (issue 24): a second panel with reward accuracy (train, eval) and
reward margin per step, read back from matplotlib's own objects and from the PNG; an SFT run's
figure, the control, keeps its single loss panel."""

from __future__ import annotations

import matplotlib.image

from scaletune.trainer.metrics import loss_figure, plot_losses

SFT = [
    {"step": 1, "stage": "main", "stage_step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 900.0},
    {"step": 2, "stage": "main", "stage_step": 2, "loss": 2.2, "lr": 1e-3, "grad_norm": 0.9, "tokens_per_s": 950.0},
    {"step": 2, "stage": "main", "eval_loss": 2.3},
    {"step": 3, "stage": "main", "stage_step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.8, "tokens_per_s": 940.0},
]
# The fixed keys of a DPO run's lines (interface of issue 24): train lines then eval lines.
DPO = [
    {
        "step": 1,
        "loss": 0.693,
        "reward_accuracy": 0.5,
        "reward_margin": 0.0,
        "logp_chosen": -40.0,
        "logp_rejected": -41,
    },
    {
        "step": 2,
        "loss": 0.62,
        "reward_accuracy": 0.625,
        "reward_margin": 0.2,
        "logp_chosen": -39.5,
        "logp_rejected": -42,
    },
    {"step": 2, "eval_loss": 0.65, "eval_reward_accuracy": 0.55, "eval_reward_margin": 0.1},
    {
        "step": 3,
        "loss": 0.51,
        "reward_accuracy": 0.875,
        "reward_margin": 0.6,
        "logp_chosen": -39.0,
        "logp_rejected": -44,
    },
    {"step": 4, "eval_loss": 0.58, "eval_reward_accuracy": 0.8, "eval_reward_margin": 0.4},
]


def lines_of(ax) -> dict[str, tuple[list, list]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


def test_sft_figure_has_the_loss_panel_only(tmp_path):
    fig = loss_figure(SFT)
    assert len(fig.axes) == 1
    assert lines_of(fig.axes[0]) == {"train loss": ([1, 2, 3], [2.5, 2.2, 2.0]), "eval loss": ([2], [2.3])}
    assert fig.axes[0].get_ylabel() == "mean token loss"
    plot_losses(SFT, tmp_path / "loss.png")
    assert matplotlib.image.imread(tmp_path / "loss.png").shape[:2] == (400, 700)


def test_preference_figure_adds_reward_accuracy_and_margin(tmp_path):
    fig = loss_figure(DPO)
    loss_ax, acc_ax, margin_ax = fig.axes  # the margin's axis is the accuracy panel's twin
    assert lines_of(loss_ax) == {"train loss": ([1, 2, 3], [0.693, 0.62, 0.51]), "eval loss": ([2, 4], [0.65, 0.58])}
    assert lines_of(acc_ax) == {
        "train reward accuracy": ([1, 2, 3], [0.5, 0.625, 0.875]),
        "eval reward accuracy": ([2, 4], [0.55, 0.8]),
    }
    assert lines_of(margin_ax) == {
        "train reward margin": ([1, 2, 3], [0.0, 0.2, 0.6]),
        "eval reward margin": ([2, 4], [0.1, 0.4]),
    }
    assert margin_ax.get_position().bounds == acc_ax.get_position().bounds
    assert (acc_ax.get_xlabel(), acc_ax.get_ylabel()) == ("optimizer step", "reward accuracy")
    assert margin_ax.get_ylabel().startswith("reward margin")
    assert acc_ax.get_ylim()[0] <= 0 and acc_ax.get_ylim()[1] >= 1
    assert {t.get_text() for t in acc_ax.get_legend().get_texts()} == set(lines_of(acc_ax)) | set(lines_of(margin_ax))
    plot_losses(DPO, tmp_path / "loss.png")
    assert matplotlib.image.imread(tmp_path / "loss.png").shape[:2] == (700, 700)


def test_eval_only_reward_lines_still_get_the_panel():
    """A run evaluated at step 0 before its first logged step, or a KTO run (margin, no accuracy)."""
    fig = loss_figure([*SFT, {"step": 0, "eval_loss": 0.69, "eval_reward_accuracy": 0.5}])
    assert len(fig.axes) == 2 and lines_of(fig.axes[1]) == {"eval reward accuracy": ([0], [0.5])}
    kto = loss_figure([{"step": 1, "loss": 0.7, "reward_margin": 0.1, "kl": 0.0}])
    assert len(kto.axes) == 3 and lines_of(kto.axes[1]) == {} and lines_of(kto.axes[2])["train reward margin"]
