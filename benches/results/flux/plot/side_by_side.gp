set terminal pngcairo size 1260,420 font ',9'
set output 'benches/results/flux/side_by_side.png'
set multiplot layout 1,3
set logscale xy
set grid
set key top left
set datafile missing '?'
set xlabel 'N (tasks)'
set xtics (64, 256, 1024)
set title '(a) all-to-all'
set ylabel 'seconds'
plot 'benches/results/flux/plot/a.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', 'benches/results/flux/plot/a.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
set title '(b) business cards'
set ylabel 'seconds'
plot 'benches/results/flux/plot/b.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', 'benches/results/flux/plot/b.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
set title '(c) 1000 empty barriers'
set ylabel 'ms per barrier'
plot 'benches/results/flux/plot/c.dat' using 1:2:3:4 with yerrorlines title 'flux run -o pmi=rpmi', 'benches/results/flux/plot/c.dat' using 1:5:6:7 with yerrorlines title 'flux run, pmi-simple'
unset multiplot
