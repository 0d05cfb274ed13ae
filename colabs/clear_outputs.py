"""Clears the outputs and execution counts of the notebooks, in place.

tests/test_colabs.py fails while a committed notebook carries outputs. Before committing a
notebook you ran:

  python colabs/clear_outputs.py                      # every colabs/*.ipynb
  python colabs/clear_outputs.py colabs/quickstart.ipynb

(nbformat comes with the `test` extra; Jupyter's *Edit > Clear Outputs of All Cells* does the
same for one notebook.)
"""

import glob
import os
import sys

import nbformat

COLABS = os.path.dirname(os.path.abspath(__file__))


def clear(path: str) -> None:
  """Rewrites the notebook at `path` without outputs and execution counts."""
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == 'code':
      cell.outputs = []
      cell.execution_count = None
  nbformat.write(notebook, path)


if __name__ == '__main__':
  for notebook_path in sys.argv[1:] or sorted(glob.glob(os.path.join(COLABS, '*.ipynb'))):
    clear(notebook_path)
