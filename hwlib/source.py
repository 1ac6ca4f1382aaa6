"""Where hwlib's code is published, and the git ref that the notebooks install under Colab.

A notebook's setup cell runs before hwlib can be imported, so it carries its own copy of both
(``hwlib.release.setup_cell`` writes it; ``tests/test_colab.py`` checks that every notebook's copy
equals this one). ``python -m hwlib.release pin-notebooks --ref REF`` (``make pin-notebooks REF=...``)
rewrites ``NOTEBOOK_REF`` below and every notebook's setup cell together.
"""

REPOSITORY = "https://github.com/hwlib/hwlib"

# ``main`` between releases: the Colab badges open the notebooks of main, so main's code is what
# they must install. A commit hash cannot be written into the commit it names (the hash depends on
# the content), so a release pins a tag: pin to the tag, commit, then create the tag on that commit.
NOTEBOOK_REF = "main"
