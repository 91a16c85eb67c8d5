set terminal pngcairo size 1260,420 font ',9'
set output '/tmp/fluxbench3/side_by_side.png'
set multiplot layout 1,3
set logscale xy
set grid
set key top left
set datafile missing '?'
set xlabel 'N (tasks)'
set xtics (64, 256, 1024)
set title '(a) all-to-all'
set ylabel 'seconds'
plot '/tmp/fluxbench3/plot/a.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', '/tmp/fluxbench3/plot/a.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
set title '(b) business cards'
set ylabel 'seconds'
plot '/tmp/fluxbench3/plot/b.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', '/tmp/fluxbench3/plot/b.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
set title '(c) 1000 empty barriers'
set ylabel 'ms per barrier'
plot '/tmp/fluxbench3/plot/c.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', '/tmp/fluxbench3/plot/c.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
unset multiplot
