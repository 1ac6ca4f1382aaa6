"""The lab's interactive face, in ipywidgets: a live monitor of a running measurement
(``monitor``) and an explorer of recorded results (``explorer``). Both leave a static copy (a
figure, a table) in the notebook, which is what a papermill run keeps."""
