//! SVG plots of the comparisons (`simulate`, `emulated_compare`): time against the
//! number of workers, measured against predicted, and where an emulated network was
//! faithful. SVG alone, so that no system font or image library is needed: the text is
//! SVG text, set by the viewer.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One line or set of points of a plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Which of the plot's colours; a model and what it models share one.
    pub colour: usize,
    /// A model, drawn dashed (and so named in the legend), beside measurements or
    /// simulations drawn solid with marks.
    pub model: bool,
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x8c, 0x56, 0x4b),
];

const SIZE: (u32, u32) = (760, 480);

fn colour(index: usize) -> RGBColor {
    COLOURS[index % COLOURS.len()]
}

/// Why a plot could not be written: the file, and what went wrong.
fn failed(path: &Path, error: impl std::fmt::Display) -> String {
    format!("plotting {}: {error}", path.display())
}

/// The smallest and largest of `values`, widened so that a log axis shows them all.
fn log_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (low, high) = values
        .filter(|value| value.is_finite() && *value > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(low, high), value| (low.min(value), high.max(value)));
    if high == 0.0 {
        return 0.1..10.0;
    }
    low / 1.5..high * 1.5
}

/// Tick marks of a log axis within `range`: each power of ten times each of
/// `multiples`.
fn ticks(range: &Range<f64>, multiples: &[f64]) -> Vec<f64> {
    let lowest = range.start.log10().floor() as i32;
    let highest = range.end.log10().ceil() as i32;
    let marks = (lowest..=highest).flat_map(|power| multiples.iter().map(move |m| m * 10f64.powi(power)));
    marks.filter(|mark| range.contains(mark)).collect()
}

/// 1, 2 and 5 times the powers of ten: a log axis of times or rates.
fn decades(range: &Range<f64>) -> Vec<f64> {
    ticks(range, &[1.0, 2.0, 5.0])
}

/// The powers of two: a log axis of worker counts.
fn powers_of_two(range: &Range<f64>) -> Vec<f64> {
    (0..=20).map(|power| f64::from(1u32 << power)).filter(|mark| range.contains(mark)).collect()
}

/// A tick's label: as few digits as the value needs.
fn label(value: &f64) -> String {
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn canvas(path: &Path) -> Result<DrawingArea<SVGBackend<'_>, Shift>, String> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    Ok(root)
}

/// Time against the number of workers, both on log scales: one line per series.
pub fn time_against_workers(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), String> {
    let root = canvas(path)?;
    let points = || series.iter().flat_map(|series| series.points.iter());
    let x_range = log_range(points().map(|&(x, _)| x));
    let y_range = log_range(points().map(|&(_, y)| y));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            x_range.clone().log_scale().with_key_points(powers_of_two(&x_range)),
            y_range.clone().log_scale().with_key_points(decades(&y_range)),
        )
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .x_desc("workers (N)")
        .y_desc(y_label)
        .x_label_formatter(&label)
        .y_label_formatter(&label)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| failed(path, e))?;
    for series in series {
        let style = colour(series.colour).stroke_width(2);
        let points = series.points.iter().copied();
        let drawn = if series.model {
            chart.draw_series(DashedLineSeries::new(points, 6, 4, style))
        } else {
            chart.draw_series(LineSeries::new(points, style).point_size(3))
        };
        let name = if series.model { format!("{} (dashed)", series.name) } else { series.name.clone() };
        drawn
            .map_err(|e| failed(path, e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))
}

/// One comparison of a prediction with a measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Agreement {
    pub predicted: f64,
    pub measured: f64,
    /// Which kind (netagg, the ring), by colour.
    pub colour: usize,
}

/// Measured against predicted, on log scales, with the diagonal and ±10 % about it:
/// points between the dashed lines agree within 10 %.
pub fn measured_against_predicted(
    path: &Path,
    title: &str,
    kinds: &[&str],
    points: &[Agreement],
) -> Result<(), String> {
    let root = canvas(path)?;
    let range = log_range(points.iter().flat_map(|point| [point.predicted, point.measured]));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            range.clone().log_scale().with_key_points(decades(&range)),
            range.clone().log_scale().with_key_points(decades(&range)),
        )
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .x_desc("predicted by the simulator (s)")
        .y_desc("measured on the emulator (s)")
        .x_label_formatter(&label)
        .y_label_formatter(&label)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| failed(path, e))?;
    let ends = [range.start, range.end];
    for factor in [1.0, 0.9, 1.1] {
        let line = ends.iter().map(|&x| (x, x * factor));
        if factor == 1.0 {
            chart.draw_series(LineSeries::new(line, BLACK)).map_err(|e| failed(path, e))?;
        } else {
            chart
                .draw_series(DashedLineSeries::new(line, 5, 5, BLACK.mix(0.5).into()))
                .map_err(|e| failed(path, e))?;
        }
    }
    for (index, kind) in kinds.iter().enumerate() {
        let style = colour(index).filled();
        let marks = points
            .iter()
            .filter(|point| point.colour == index)
            .map(|point| Circle::new((point.predicted, point.measured), 5, style));
        chart
            .draw_series(marks)
            .map_err(|e| failed(path, e))?
            .label(*kind)
            .legend(move |(x, y)| Circle::new((x + 10, y), 5, style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))
}

/// One emulated run's network, and whether the links set its pace.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub workers: f64,
    pub megabits_per_second: f64,
    pub faithful: bool,
}

/// Where the emulator is faithful: each network run, by workers and link rate, marked
/// by whether its links set the pace (faithful) or the machine did.
pub fn faithful_region(path: &Path, title: &str, verdicts: &[Verdict]) -> Result<(), String> {
    let root = canvas(path)?;
    let x_range = log_range(verdicts.iter().map(|verdict| verdict.workers));
    let y_range = log_range(verdicts.iter().map(|verdict| verdict.megabits_per_second));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            x_range.clone().log_scale().with_key_points(powers_of_two(&x_range)),
            y_range.clone().log_scale().with_key_points(decades(&y_range)),
        )
        .map_err(|e| failed(path, e))?;
    chart
        .configure_mesh()
        .x_desc("workers (N)")
        .y_desc("link rate (Mbit/s)")
        .x_label_formatter(&label)
        .y_label_formatter(&label)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| failed(path, e))?;
    for (faithful, name, index) in
        [(true, "the links set the pace", 2), (false, "in some run, the machine did (CPU, delay)", 1)]
    {
        let style = colour(index).filled();
        let marks = verdicts
            .iter()
            .filter(|verdict| verdict.faithful == faithful)
            .map(|verdict| Circle::new((verdict.workers, verdict.megabits_per_second), 6, style));
        chart
            .draw_series(marks)
            .map_err(|e| failed(path, e))?
            .label(name)
            .legend(move |(x, y)| Circle::new((x + 10, y), 6, style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temporary(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("netagg-plot-{}-{name}", std::process::id()))
    }

    #[test]
    fn log_axes_are_marked_at_round_values() {
        assert_eq!(decades(&(0.15..30.0)), [0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]);
        assert_eq!(powers_of_two(&(1.5..20.0)), [2.0, 4.0, 8.0, 16.0]);
        assert_eq!(
            (label(&0.2), label(&1000.0), label(&0.125)),
            ("0.2".into(), "1000".into(), "0.125".into())
        );
    }

    #[test]
    fn plots_are_svg_with_their_labels() {
        let path = temporary("workers.svg");
        let series = [
            Series { name: "netagg".into(), points: vec![(2.0, 0.4), (8.0, 0.4)], colour: 0, model: false },
            Series {
                name: "ring model".into(),
                points: vec![(2.0, 0.4), (8.0, 0.7)],
                colour: 1,
                model: true,
            },
        ];
        time_against_workers(&path, "time", "seconds", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("netagg") && svg.contains("ring model (dashed)"),
            "{svg}"
        );

        let points = [Agreement { predicted: 0.37, measured: 0.38, colour: 0 }];
        measured_against_predicted(&path, "agreement", &["netagg"], &points).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("predicted by the simulator"));

        let verdicts = [Verdict { workers: 8.0, megabits_per_second: 100.0, faithful: false }];
        faithful_region(&path, "faithful", &verdicts).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("the machine did"));
        std::fs::remove_file(&path).unwrap();
    }
}
