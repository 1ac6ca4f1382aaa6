"""The screenshot script's page: the README served offline shows the repository's own files."""

from hwlib.report import screenshots, tables


def test_the_readme_s_links_to_repository_files_point_at_the_local_copies():
    fig = "outputs/reference/h100/figures/gpt_ladder.png"
    nb = "outputs/reference/h100/executed/09_cuda_graphs.ipynb"
    text = (f"[![gpt]({tables.raw_url(fig)})]({tables.repo_url(fig)}) and [09]({tables.repo_url(nb)}); "
            "[Colab](https://colab.research.google.com/github/x/y) stays")
    local, named = screenshots.localized_readme(text)
    assert local == (f"[![gpt]({fig})]({fig}) and [09]({nb}); "
                     "[Colab](https://colab.research.google.com/github/x/y) stays")
    assert named == sorted({fig, nb})


def test_the_committed_readme_names_its_figures_as_repository_files():
    local, named = screenshots.localized_readme((screenshots.ROOT / "README.md").read_text())
    figures = [n for n in named if n.endswith(".png")]
    assert figures and all((screenshots.ROOT / n).is_file() for n in figures), figures
    assert tables.raw_url("") not in local


def test_badges_are_not_figures():
    assert screenshots._badge("https://colab.research.google.com/assets/colab-badge.svg")
    assert not screenshots._badge("http://127.0.0.1:8888/files/outputs/reference/h100/figures/gpt_ladder.png")
