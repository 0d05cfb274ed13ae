"""experiments.lib.plotting: the figure helpers every study uses."""

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

from experiments.lib import plotting  # noqa: E402


def test_save_titles_writes_and_closes(tmp_path):
  fig, ax = plt.subplots()
  ax.plot([0, 1], [0, 1], label='line')
  plotting.legend_below(fig, ax, ncol=2)
  assert [t.get_text() for t in fig.legends[0].get_texts()] == ['line']
  plotting.square(ax, 3.0)
  assert ax.get_xlim() == (-3.0, 3.0) and ax.get_ylim() == (-3.0, 3.0)
  assert ax.get_aspect() == 1.0
  number = fig.number
  assert plotting.save(fig, str(tmp_path), 'a.png', title='T', fontsize=9) == 'a.png'
  assert fig._suptitle.get_text() == 'T' and fig._suptitle.get_fontsize() == 9
  assert (tmp_path / 'a.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert number not in plt.get_fignums()
  fig, _ = plt.subplots()
  plotting.save(fig, str(tmp_path), 'b.png', dpi=50)
  assert fig._suptitle is None and (tmp_path / 'b.png').stat().st_size > 0
