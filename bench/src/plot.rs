//! Curves for `BENCHMARKS.md`, drawn as SVG with plotters.

use std::path::Path;

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

/// Draws `series` as lines with min-max bars, x on a log scale, into an SVG
/// file at `path` (800 x 480).
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_min, x_max) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1.max))
        .fold(0.0_f64, f64::max);
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
        .build_cartesian_2d((x_min * 0.8..x_max * 1.25).log_scale(), 0.0..y_max * 1.1)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|x| format!("{}", x.round()))
        .y_label_formatter(&|y| format!("{y:.0}"))
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
