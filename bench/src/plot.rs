//! Curves for `BENCHMARKS.md`, drawn as SVG with plotters.
//!
//! [`lines`] draws y on a linear scale from 0; [`lines_log`] draws y on a
//! log scale too, for curves whose values differ by orders of magnitude
//! (the scale benchmark puts the memory driver's hundreds of thousands of
//! messages per second beside the SQS emulator's hundreds): a flat curve is
//! a horizontal line on either, and on a log scale equal ratios are equal
//! distances.

use std::path::Path;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use serde::Serialize;

use crate::Spread;

/// One curve: a backend's throughput (or cost) at each x.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// The legend, e.g. "RabbitMQ".
    pub name: String,
    /// (x, spread of y over the rounds), in increasing x.
    pub points: Vec<(f64, Spread)>,
}

/// Draws `series` as lines with min-max bars, x on a log scale, y linear
/// from 0, into an SVG file at `path` (800 x 480).
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let (_, y_max) = y_bounds(series)?;
    draw(path, title, x_label, y_label, series, 0.0..y_max * 1.1)
}

/// [`lines`] with y on a log scale as well.
pub fn lines_log(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let (y_min, y_max) = y_bounds(series)?;
    let y_min = if y_min > 0.0 { y_min } else { y_max / 1e3 };
    draw(
        path,
        title,
        x_label,
        y_label,
        series,
        (y_min / 1.5..y_max * 1.5).log_scale(),
    )
}

/// The smallest and largest y of every point's range.
fn y_bounds(series: &[Series]) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let points = series.iter().flat_map(|s| s.points.iter());
    let (lo, hi) = points.fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1.min), hi.max(p.1.max))
    });
    if lo > hi {
        return Err("nothing to plot".into());
    }
    Ok((lo, hi))
}

/// A y label with as many decimals as its size needs.
fn y_label(y: f64) -> String {
    let a = y.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{y:.0}")
    } else if a >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.2}")
    }
}

fn draw<Y>(
    path: &Path,
    title: &str,
    x_label: &str,
    y_desc: &str,
    series: &[Series],
    y_range: Y,
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_min, x_max) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if series.is_empty() || x_min > x_max {
        return Err("nothing to plot".into());
    }
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x_min * 0.8..x_max * 1.25).log_scale(), y_range)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{}", x.round()))
        .y_label_formatter(&|y| y_label(*y))
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                s.points.iter().map(|(x, y)| (*x, y.median)),
                color.stroke_width(2),
            ))?
            .label(&s.name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(
            s.points
                .iter()
                .map(|(x, y)| Circle::new((*x, y.median), 3, color.filled())),
        )?;
        chart.draw_series(s.points.iter().map(|(x, y)| {
            PathElement::new(vec![(*x, y.min), (*x, y.max)], color.stroke_width(1))
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}
