//! The latency plot (SVG): every request over time, where jitter and stalls show at a glance,
//! and the latency by percentile up to 99.99 %, one colour per target.

use std::path::Path;

use plotters::prelude::*;

use super::load::Outcome;

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Points drawn per target at most (an SVG of every request of a long run would be huge).
const MAX_POINTS: usize = 20_000;

/// Writes the plot of `targets` (name, outcome) to `path`.
pub fn write(path: &Path, title: &str, targets: &[(&str, &Outcome)]) -> Result<(), String> {
    draw(path, title, targets).map_err(|e| format!("cannot write the plot {}: {e}", path.display()))
}

fn draw(
    path: &Path,
    title: &str,
    targets: &[(&str, &Outcome)],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1100, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(440);

    let t_max = targets
        .iter()
        .flat_map(|(_, o)| o.samples.iter().map(|s| s.at_s))
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let y_max = targets
        .iter()
        .map(|(_, o)| o.hist.max() as f64 / 1000.0)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;

    let mut chart = ChartBuilder::on(&top)
        .caption("latency of every request over time", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time into the measured window (s)")
        .y_desc("latency (ms)")
        .draw()?;
    for (i, (name, o)) in targets.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let step = o.samples.len().div_ceil(MAX_POINTS).max(1);
        chart
            .draw_series(
                o.samples
                    .iter()
                    .step_by(step)
                    .map(move |s| Circle::new((s.at_s, s.latency_ms), 1, c.filled())),
            )?
            .label(*name)
            .legend(move |(x, y)| Circle::new((x, y), 4, c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    // Percentiles on a log scale of 1/(1-p): 0 = 0 %, 1 = 90 %, 2 = 99 %, 3 = 99.9 % …
    let nines = 4.0;
    let mut chart = ChartBuilder::on(&bottom)
        .caption("latency by percentile", ("sans-serif", 16))
        .margin(12)
        .margin_right(40)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..nines, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_labels(nines as usize + 1)
        .x_label_formatter(&|x| {
            let p = 100.0 * (1.0 - 10f64.powf(-x));
            format!("{}%", (p * 100.0).round() / 100.0)
        })
        .x_desc("percentile")
        .y_desc("latency (ms)")
        .draw()?;
    for (i, (name, o)) in targets.iter().enumerate() {
        if o.hist.is_empty() {
            continue;
        }
        let c = COLOURS[i % COLOURS.len()];
        let points = (0..=(nines as usize * 100)).map(|k| {
            let x = k as f64 / 100.0;
            let q = (1.0 - 10f64.powf(-x)).min(1.0);
            (x, o.hist.value_at_quantile(q) as f64 / 1000.0)
        });
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
